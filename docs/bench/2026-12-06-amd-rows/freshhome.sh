#!/bin/bash
# a fresh omnidraft home whose models (unpacked, dequantized) are hard links to $SRC's: no costs, caches or choices
SRC=${SRC:-/work/s15/src}
H=$1; rm -rf $H; mkdir -p $H/models
for d in $SRC/models/*; do cp -al $d $H/models/; done
echo $H
