set -x
mkdir -p /tmp/t && tar xf clean.tar -C /tmp/t && cd /tmp/t && python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python -m pytest -q -m gpu tests/gpu/test_backend_cuda.py -k default_budget -p no:cacheprovider 2>&1 | tail -2
python bench/train.py --model 3b --tokens 32768 --gpu-memory 40GiB --systems megatrain,megatrain,megatrain --steps 6 --warmup 2 --out $OUT/train.jsonl 2>&1 | tail -40
cat ~/.cache/megatrain/rates-*.json | head -40
