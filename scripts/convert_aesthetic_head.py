#!/usr/bin/env python3
"""Convert the LAION improved-aesthetic-predictor head (a pickled .pth state dict, e.g.
sac+logos+ava1-l14-linearMSE.pth from github.com/christophschuhmann/improved-aesthetic-predictor)
to safetensors for the `aesthetic` reward.

This is the one place flowrl reads a pickle: once, on a file you chose, with
torch.load(weights_only=True), which refuses anything but tensors and plain containers.
The result is checked against the MLP the reward builds before it is written.

Usage:  python scripts/convert_aesthetic_head.py FILE.pth [OUT.safetensors]
        (default OUT: the reward cache, $FLOWRL_CACHE/rewards/aesthetic_head.safetensors,
        where the reward looks when reward.options.aesthetic.head is not set)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rewards.aesthetic import HEAD_FILE, AestheticHead  # noqa: E402
from rewards.hub import reward_cache_dir  # noqa: E402


def convert(src: str | Path, dst: str | Path | None = None) -> Path:
    state = torch.load(str(src), map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)  # a Lightning checkpoint nests it
    head = AestheticHead.from_state_dict(state, str(src))  # raises if it is not the MLP
    dst = Path(dst) if dst else reward_cache_dir() / HEAD_FILE
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(dst), metadata={"source": Path(src).name})
    return dst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the original .pth state dict")
    p.add_argument("dst", nargs="?", help="output .safetensors (default: the reward cache)")
    args = p.parse_args()
    print(f"wrote {convert(args.src, args.dst)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
