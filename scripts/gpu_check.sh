#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (see ../shared/device/README.md): everything here runs
# the package from the source tree, from wheels in .whl/ (../shared/device/prepare-wheels.sh
# psutil). Results and full logs go to $OUT; a small table is printed last.
#
#   0. a study of the user's own training script on CUDA (examples/flags.toml, its command
#      run with this machine's python3), and with several GPUs its torchrun version
#      (examples/torchrun.toml, {ranks} = one per GPU): the trials' readings in the
#      script's own loop;
#   1. doctor on studies/gpu.toml;
#   2. `python -m benchmarks speedup --config studies/gpu.toml`: a real 20-trial study on CUDA,
#      then baseline, rule of thumb and recommendation side by side with their ceilings;
#   3. `python -m benchmarks claims --config studies/gpu.toml --studies 2`: two studies' claimed
#      speedups (paired confirmation, 95% CI) against a side-by-side measurement afterwards;
#   4. a study whose large batches really run out of GPU memory (scripts/gpu_oom.toml): with
#      gradient accumulation (the default) they are measured as micro-batches that fit;
#   5. the ImageNet-like reference (studies/imagenet-like.toml): `make-images`, then
#      a real study of a ResNet-18 on 224px crops and the same side by side as in 2; then the
#      same under the user's real step: bf16 autocast + torch.compile +
#      channels_last (a copy of the config with those three [training] keys);
#   6. `python -m benchmarks steps`: the quickstart and text workloads' ceilings and best
#      settings under fp32 eager, bf16, compile and bf16 + compile and fp16 with
#      its GradScaler through `tests/test_step.py` (skipped on a CPU);
#   7. a 2-rank smoke study on the one GPU (both ranks on cuda:0, gloo).
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

step "your own training script on CUDA (examples/flags.toml)"
sed 's/"python", "train.py"/"python3", "train.py"/' examples/flags.toml > examples/gpu-flags.toml
timeout 300 python3 -m loader_search run examples/gpu-flags.toml --storage "sqlite:///$OUT/command.db" \
  > "$OUT/command.log" 2>&1
echo "command study exit $?"; tail -30 "$OUT/command.log"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ]; then
  sed 's/"torchrun", /"python3", "-m", "torch.distributed.run", /; s/^ranks = 2 .*/ranks = "auto"/' \
    examples/torchrun.toml > examples/gpu-torchrun.toml
  timeout 300 python3 -m loader_search run examples/gpu-torchrun.toml \
    --storage "sqlite:///$OUT/command.db" > "$OUT/torchrun.log" 2>&1
  echo "torchrun study exit $?"; tail -30 "$OUT/torchrun.log"
fi
rm -f examples/gpu-flags.toml examples/gpu-torchrun.toml

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
  # The user's real step: bf16 autocast, torch.compile, channels_last.
  sed 's/^\[training\]$/[training]\nprecision = "bf16"\ncompile = true\nchannels_last = true\nwarmup_batches = 8/' \
    studies/imagenet-like.toml > "$OUT/imagenet-fast.toml"
  sed -i "s/^name = \"imagenet-like\"$/name = \"imagenet-fast\"/; s|^root = .*|root = \"$PWD/data/imagenet-like\"|" \
    "$OUT/imagenet-fast.toml"
  python3 -m benchmarks speedup --config "$OUT/imagenet-fast.toml" --rounds 2 \
    --out "$OUT/imagenet-fast" > "$OUT/imagenet-fast.log" 2>&1
  echo "imagenet-like bf16+compile+channels_last exit $?"; tail -40 "$OUT/imagenet-fast.log"
else
  echo "torchvision does not import here: skipped"; tail -3 "$OUT/imagenet.log"
fi

step "the step variants (benchmarks steps) and fp16 with its GradScaler"
python3 -m benchmarks steps --out "$OUT/steps" > "$OUT/steps.log" 2>&1
echo "steps exit $?"; tail -20 "$OUT/steps.log"
python3 -m pytest -q -p no:cacheprovider tests/test_step.py > "$OUT/test_step.log" 2>&1
echo "test_step exit $?"; tail -5 "$OUT/test_step.log"

step "2-rank smoke study on one GPU"
sed 's/^\[training\]$/[training]\nranks = 2/; s/^trials = .*/trials = 4/' studies/gpu.toml \
  > "$OUT/ranks.toml"
sed -i 's/^name = "gpu"$/name = "gpu-ranks"/' "$OUT/ranks.toml"
python3 -m loader_search run "$OUT/ranks.toml" --storage "sqlite:///$OUT/ranks.db" \
  > "$OUT/ranks.log" 2>&1
echo "ranks study exit $?"; tail -30 "$OUT/ranks.log"

step "summary"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
import optuna
out = Path(sys.argv[1])
optuna.logging.set_verbosity(optuna.logging.WARNING)
rows = []
for folder, study_name in (
    ("speedup", "gpu"), ("imagenet", "imagenet-like"), ("imagenet-fast", "imagenet-fast")
):
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
try:
    rows.append((out / "steps" / "steps.md").read_text())
except Exception as exc:
    rows.append(f"steps: no result ({exc!r})")
try:
    study = optuna.load_study(study_name="gpu-ranks", storage=f"sqlite:///{out}/ranks.db")
    for t in study.trials:
        a = t.user_attrs
        rows.append(f"ranks #{t.number}: {t.state.name} {a.get('failure_reason', '')}"
                    f" {t.values[0] if t.values else 0:,.0f} samples/s ranks {a.get('ranks')}"
                    f" per rank {a.get('per_rank', {}).get('throughput_samples_per_s')}")
except Exception as exc:
    rows.append(f"ranks: no result ({exc!r})")
text = "\n".join(rows)
(out / "summary.txt").write_text(text + "\n")
print(text)
PY
