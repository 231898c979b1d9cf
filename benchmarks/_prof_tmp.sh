export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python -m pytest -q -x tests/test_packing.py -k cuda 2>&1 | tail -2
python -m longqa.cli bench train --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --repeat 3 --compile --json $OUT/c17.json 2>&1 | grep -v Warn | tail -5
