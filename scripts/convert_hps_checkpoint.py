#!/usr/bin/env python3
"""Convert an HPSv2 checkpoint (the pickled HPS_v2.1_compressed.pt or HPS_v2_compressed.pt
of the hub repo xswu/HPSv2) to safetensors for the `hpsv2` reward.

This and scripts/convert_aesthetic_head.py are the only places flowrl reads a pickle: once,
on a file you chose, with torch.load(weights_only=True), which refuses anything but tensors
and plain containers.

Usage:  huggingface-cli download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir .
        python scripts/convert_hps_checkpoint.py HPS_v2.1_compressed.pt [OUT.safetensors]
        (default OUT: the reward cache, $FLOWRL_CACHE/rewards/hps_v2.1.safetensors, where
        the reward looks when reward.options.hpsv2.checkpoint is not set)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rewards.hps import CHECKPOINT_FILE  # noqa: E402
from rewards.hub import reward_cache_dir  # noqa: E402


def convert(src: str | Path, dst: str | Path | None = None) -> Path:
    checkpoint = torch.load(str(src), map_location="cpu", weights_only=True)
    state = checkpoint.get("state_dict", checkpoint)
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"{src} holds no state dict of tensors; expected HPS_v2.1_compressed.pt or HPS_v2_compressed.pt")
    state = {k.removeprefix("module."): v for k, v in state.items()}  # saved from DistributedDataParallel
    dst = Path(dst) if dst else reward_cache_dir() / CHECKPOINT_FILE
    dst.parent.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share memory: give each its own contiguous copy
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(dst), metadata={"source": Path(src).name})
    return dst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="HPS_v2.1_compressed.pt or HPS_v2_compressed.pt")
    p.add_argument("dst", nargs="?", help="output .safetensors (default: the reward cache)")
    args = p.parse_args()
    print(f"wrote {convert(args.src, args.dst)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
