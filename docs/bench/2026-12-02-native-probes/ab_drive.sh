#!/bin/bash
# alternate builds (tags given as name=hash) in fresh processes; $1 adapter, $2 rows, $3 rounds, rest builds
K=~/.cache/omnidraft/kernels
A=$1; R=$2; N=$3; shift 3
for i in $(seq $N); do
  for nb in "$@"; do
    name=${nb%%=*}; so=$(ls $K/qdraft_${nb#*=}*/*.so)
    echo "$name $(cd /work/main && .venv/bin/python /tmp/lora/one.py $A $so $R)"
  done
done
