python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 400 python3 benchmarks/megakernel_skeleton_gpu.py --out $OUT/mk.jsonl --products s8 --convert --layers 8 --stages 2 --served 2>&1 | grep -E "^\[|^served|Error|error" | tail -4
nvidia-smi --query-gpu=clocks.sm --format=csv,noheader
