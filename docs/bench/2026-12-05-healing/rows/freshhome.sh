#!/bin/bash
# a fresh omnidraft home whose models (unpacked, dequantized) are links to /work/home1's: no costs, caches or choices
H=$1; rm -rf $H; mkdir -p $H/models
for d in /work/home1/models/*; do case $(basename $d) in costs|gguf-index) ;; *) ln -s $d $H/models/;; esac; done
echo $H
