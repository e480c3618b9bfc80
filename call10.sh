set -u
pip install -q --no-deps --no-index --target /tmp/dd .whl/*.whl > $OUT/deps.log 2>&1; echo "deps rc=$?"
export PYTHONPATH=/tmp/dd
STEPS="models" ROWS=hunyuan-video-fp16 VARIANTS=compile,compile+fusion,compile+fusion-nopad ROUNDS=5 MODELS_NAME=video_pad BUDGET_S=250 bash scripts/dev/device_run.sh
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
