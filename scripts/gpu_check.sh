#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (see ../shared/device/README.md): everything here runs
# the package from the source tree, from wheels in .whl/ (../shared/device/prepare-wheels.sh
# psutil). Results and full logs go to $OUT; a small table is printed last.
#
#   1. doctor on studies/gpu.toml;
#   2. `python -m benchmarks speedup --config studies/gpu.toml`: a real 20-trial study on CUDA,
#      then baseline, rule of thumb and recommendation side by side with their ceilings;
#   3. `python -m benchmarks claims --config studies/gpu.toml --studies 2`: two studies' claimed
#      speedups (paired confirmation, 95% CI) against a side-by-side measurement afterwards;
#   4. a study whose large batches really run out of GPU memory (scripts/gpu_oom.toml): with
#      gradient accumulation (the default) they are measured as micro-batches that fit;
#   5. the ImageNet-like reference (studies/imagenet-like.toml, issue 15): `make-images`, then
#      a real study of a ResNet-18 on 224px crops and the same side by side as in 2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export LOADER_SEARCH_LOCK_DIR=$OUT/locks

step() { echo; echo "=== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'

step "doctor"
python3 -m loader_search doctor studies/gpu.toml 2>&1 | tee "$OUT/doctor.txt"

step "study + side by side (studies/gpu.toml)"
python3 -m benchmarks speedup --config studies/gpu.toml --rounds 3 --out "$OUT/speedup" \
  > "$OUT/speedup.log" 2>&1
echo "speedup exit $?"; tail -40 "$OUT/speedup.log"

step "claimed speedup against side by side (studies/gpu.toml)"
python3 -m benchmarks claims --config studies/gpu.toml --studies 2 --claim-rounds 6 \
  --out "$OUT/claims" > "$OUT/claims.log" 2>&1
echo "claims exit $?"; tail -20 "$OUT/claims.log"

step "real CUDA out-of-memory (scripts/gpu_oom.toml)"
python3 -m loader_search run scripts/gpu_oom.toml --storage "sqlite:///$OUT/oom.db" \
  > "$OUT/oom.log" 2>&1
echo "oom study exit $?"; tail -30 "$OUT/oom.log"

step "ImageNet-like reference (studies/imagenet-like.toml: ResNet-18 on 224px crops of JPEGs)"
# Needs torchvision: when the machine lacks it, add the wheel made for its torch to .whl/
# (../shared/device/prepare-wheels.sh 'torchvision==X.Y.Z'; torch 2.11 pairs with 0.26.0).
if python3 -c 'import torchvision' > "$OUT/imagenet.log" 2>&1; then
  python3 -m loader_search make-images data/imagenet-like > "$OUT/make-images.log" 2>&1
  echo "make-images exit $?"; tail -1 "$OUT/make-images.log"
  python3 -m benchmarks speedup --config studies/imagenet-like.toml --rounds 3 \
    --out "$OUT/imagenet" > "$OUT/imagenet.log" 2>&1
  echo "imagenet-like exit $?"; tail -40 "$OUT/imagenet.log"
else
  echo "torchvision does not import here: skipped"; tail -3 "$OUT/imagenet.log"
fi

step "summary"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
import optuna
out = Path(sys.argv[1])
optuna.logging.set_verbosity(optuna.logging.WARNING)
rows = []
for folder, study_name in (("speedup", "gpu"), ("imagenet", "imagenet-like")):
    rows.append(f"--- {study_name}")
    try:
        result = json.loads((out / folder / "speedup.json").read_text())["speedup"]
        for name, c in result["contenders"].items():
            rows.append(f"{name:<14} {c['throughput']:>9,.0f} samples/s  spread {c['spread']:4.0%}"
                        f"  ceiling {c['ceiling']:>10,.0f}  efficiency {c['efficiency']:5.1%}  {c['params']}")
        cost = result["cost"]
        rows.append(f"speedup vs baseline {result['speedup_vs_baseline']:.2f}x, vs rule of thumb"
                    f" {result['speedup_vs_rule']:.2f}x; study {cost['study_wall_s']:.0f} s,"
                    f" {cost['trials']} trials, {cost['stopped_early']} stopped early")
        storage = f"sqlite:///{out}/{folder}/speedup.db"
        study = optuna.load_study(study_name=study_name, storage=storage)
        for t in study.trials:
            a = t.user_attrs
            if t.values:
                rows.append(f"  #{t.number:<3} {t.values[0]:>9,.0f}/s val {t.values[1]:.4f}"
                            f" wait {a.get('data_wait_fraction', 0):.2f} eff {a.get('loader_efficiency', 0):.3f}"
                            f" gpu {a.get('peak_gpu_bytes', 0) / 2**30:.2f} GiB {a.get('loader_params')}")
    except Exception as exc:
        rows.append(f"{study_name}: no result ({exc!r})")
try:
    claims = json.loads((out / "claims" / "claims.json").read_text())["claims"]
    for c in claims["studies"]:
        truth = c["side_by_side"]["speedup"] if c["side_by_side"] else None
        rows.append(f"claim seed {c['seed']}: {c['claim']:.2f}x {c['claim_ci95']} {c['verdict']}"
                    f" vs side by side {truth} (error {c['claim_error']})")
except Exception as exc:
    rows.append(f"claims: no result ({exc!r})")
try:
    study = optuna.load_study(study_name="gpu-oom", storage=f"sqlite:///{out}/oom.db")
    for t in study.trials:
        a = t.user_attrs
        p = a.get("loader_params", {})
        rows.append(f"oom #{t.number}: batch {p.get('batch_size')} workers {p.get('num_workers')}"
                    f" {t.state.name} {a.get('failure_reason', 'trained')}"
                    f" as {a.get('accumulation_steps', 1)} x {a.get('micro_batch_size')}"
                    f" (ran out first: {[o['micro_batch_size'] for o in a.get('oom_attempts', [])]})"
                    f" peak {a.get('peak_gpu_bytes', 0) / 2**30:.1f} GiB"
                    f" {t.values[0] if t.values else 0:,.0f} samples/s")
except Exception as exc:
    rows.append(f"oom: no result ({exc!r})")
text = "\n".join(rows)
(out / "summary.txt").write_text(text + "\n")
print(text)
PY
