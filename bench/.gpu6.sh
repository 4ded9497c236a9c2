export PYTHONUNBUFFERED=1 GLM53_KIT_COMMIT=$1
python3 bench/bench_prefix_cache.py --real-dims --device cuda --repeats 3 --scenarios turns --out $OUT/turns_final.json > $OUT/turns_final.log 2>&1; tail -11 $OUT/turns_final.log
bash bench/run_h200.sh $1 tests > $OUT/gpu_tests_final.log 2>&1; tail -4 $OUT/gpu_tests_final.log; grep FAILED $OUT/gpu_tests_final.log | head
