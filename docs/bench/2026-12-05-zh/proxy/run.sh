cd /work/s9
export OMNIDRAFT_HOME=/work/s9/home
/usr/bin/time -v /work/main/.venv/bin/python -m omnidraft.experiments.online_proxy --target builtin:qwen2.5-coder-0.5b --set zh \
  --stream 0:100 --held-out 100:116 --configs '[{}]' --every 20 --k 4 --records /work/s9/zh-records.pt --out /work/s9/zh-proxy
