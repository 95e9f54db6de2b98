#!/bin/bash
# engine serve on a random Qwen3-0.6B-shaped checkpoint, then the request-rate sweep; results in $OUT.
[ -f /tmp/qwen3-0.6b/config.json ] || python3 -c "from engine.checkpoints import write_checkpoint; write_checkpoint('/tmp/qwen3-0.6b', 'qwen3-0.6b', progress=False)" || exit 1
python3 -m engine.server.cli serve --model /tmp/qwen3-0.6b --port 8199 --max-model-len 2048 >"$OUT/serve.log" 2>&1 &
server=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:8199/health >/dev/null && break; sleep 0.5; done
python3 benchmarks/serve_sweep.py --url http://127.0.0.1:8199 --input-len 512 --output-len 128 --json "$OUT/serve-h200.json"
kill -TERM $server; wait $server
tail -5 "$OUT/serve.log"
