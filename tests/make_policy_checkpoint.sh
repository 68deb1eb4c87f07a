#!/usr/bin/env bash
# make_policy_checkpoint.sh OUT_DIR [pi0|pi05] - a tiny Pi0 (default) or Pi0.5 checkpoint that `pi0 infer` and
# `pi0 serve` open as is (Pi0.5: 64 prompt tokens, room for the discrete state):
#   OUT_DIR/model.safetensors, config.json   random weights (pi0 init) of the pi0_tiny fixture's dims, with a
#                                            vocabulary of 2000 so that every id of the test tokenizer fits
#   OUT_DIR/paligemma_tokenizer.model        the fixtures' test SentencePiece model (2000 pieces)
#   OUT_DIR/assets/test/libero/norm_stats.json
#                                            state (8) and actions (7) stats, non-trivial mean and std, with
#                                            q01/q99 (an asset id with a '/', as openpi's often have)
# Images are 224x224 (the tiny ViT's 16x16 patches of 14); the policy resizes any camera frame to that.
# Uses $PI0_BIN (default build/pi0) and $PI0_FIXTURES (default ../shared/fixtures).
set -euo pipefail
out=${1:?usage: tests/make_policy_checkpoint.sh OUT_DIR [pi0|pi05]}
model=${2:-pi0}
bin=${PI0_BIN:-build/pi0}
fixtures=${PI0_FIXTURES:-../shared/fixtures}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the fixture's dims, but the test tokenizer's vocabulary size (the fixture model has 512)
sed 's/"vocab": *512/"vocab": 2000/' "$fixtures/pi0_tiny/config.json" >"$tmp/dims.json"
grep -q '"vocab": 2000' "$tmp/dims.json" || { echo "$0: no \"vocab\": 512 in $fixtures/pi0_tiny/config.json" >&2; exit 1; }

if [ "$model" = pi05 ]; then
    sed -i 's/"max_token_len": *[0-9]*/"max_token_len": 64/' "$tmp/dims.json"
fi
"$bin" init --model "$model" --dims "$tmp/dims.json" --output "$out" --seed 7 >/dev/null 2>"$tmp/init.log" ||
    { cat "$tmp/init.log" >&2; exit 1; }
cp -f "$fixtures/tokenizer/tok.model" "$out/paligemma_tokenizer.model"
chmod 644 "$out/paligemma_tokenizer.model"
mkdir -p "$out/assets/test/libero"
cat >"$out/assets/test/libero/norm_stats.json" <<'EOF'
{
  "norm_stats": {
    "state": {
      "mean": [-0.05, 0.03, 0.8, 3.1, -0.2, 0.1, 0.02, -0.02],
      "std": [0.1, 0.15, 0.12, 0.4, 0.3, 0.25, 0.015, 0.012],
      "q01": [-0.3, -0.3, 0.5, 2.2, -0.9, -0.5, -0.01, -0.04],
      "q99": [0.2, 0.35, 1.1, 3.9, 0.5, 0.7, 0.04, 0.0]
    },
    "actions": {
      "mean": [0.06, 0.09, -0.1, 0.004, 0.005, -0.006, -0.1],
      "std": [0.33, 0.38, 0.45, 0.04, 0.06, 0.08, 0.99],
      "q01": [-0.75, -0.8, -0.94, -0.11, -0.16, -0.22, -1.0],
      "q99": [0.9, 0.87, 0.94, 0.12, 0.17, 0.2, 1.0]
    }
  }
}
EOF
