#!/usr/bin/env python3
"""Convert ImageReward's checkpoint (the pickled ImageReward.pt of the hub repo THUDM/ImageReward)
into the directory the `imagereward` reward loads: config.json and model.safetensors, in
transformers' BLIP module names.

Like scripts/convert_hps_checkpoint.py it reads the pickle once, on a file you chose, with
torch.load(weights_only=True), which refuses anything but tensors and plain containers.

Usage:  huggingface-cli download THUDM/ImageReward ImageReward.pt --local-dir .
        python scripts/convert_imagereward_checkpoint.py ImageReward.pt [OUT_DIR]
        (default OUT_DIR: the reward cache, $FLOWRL_CACHE/rewards/imagereward, where the
        reward looks when reward.options.imagereward.checkpoint is not set)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowrl.errors import UserError  # noqa: E402
from rewards.hub import reward_cache_dir  # noqa: E402
from rewards.imagereward import CHECKPOINT_DIR, from_original  # noqa: E402


def convert(src: str | Path, dst: str | Path | None = None, vision_heads: int | None = None, text_heads: int | None = None) -> Path:
    checkpoint = torch.load(str(src), map_location="cpu", weights_only=True)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else {}
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{src} holds no state dict of tensors; expected ImageReward.pt")
    config, converted = from_original({k.removeprefix("module."): v for k, v in state.items()}, vision_heads, text_heads)
    dst = Path(dst) if dst else reward_cache_dir() / CHECKPOINT_DIR
    dst.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share memory: give each its own contiguous copy
    save_file({k: v.detach().clone().contiguous() for k, v in converted.items()}, str(dst / "model.safetensors"), metadata={"source": Path(src).name})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="ImageReward.pt")
    p.add_argument("dst", nargs="?", help="output directory (default: the reward cache)")
    args = p.parse_args()
    try:
        print(f"wrote {convert(args.src, args.dst)}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
