#!/usr/bin/env python3
"""Does a shapes model condition on the relation word? Two measures on held-out position prompts.

    python scripts/probe_relations.py                       # the shipped model
    python scripts/probe_relations.py --model DIR --prompts 100 --seeds 2
    python scripts/probe_relations.py --smoke               # the code path in seconds: a tiny random model, 2 prompts

1. Of the samples whose objects are all right (every colour, shape and count check holds),
   the fraction whose relation is right too. A model that ignores the relation scores about
   chance here (a half, less where the verifier's margin fails a near-tie).
2. The same noise, the relation word swapped ("above" <-> "below", "to the left of" <->
   "to the right of"): the mean absolute pixel difference (0-255) between the two samples.
   A model that ignores the word draws nearly the same image twice.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rewards.shapes import verify  # noqa: E402
from rewards.shapes_world import RELATIONS, eval_set  # noqa: E402
from rewards.simple import to_uint8  # noqa: E402

SWAPS = {"above": "below", "below": "above", "to the left of": "to the right of", "to the right of": "to the left of"}


def swap_relation(prompt: str) -> str:
    for word, opposite in SWAPS.items():
        if f" {word} " in prompt:
            return prompt.replace(f" {word} ", f" {opposite} ", 1)
    raise ValueError(f"'{prompt}' is not a position prompt (no {', '.join(SWAPS)})")


def relation_stats(prompts: list[str], images: np.ndarray) -> dict:
    """images: [N, H, W, 3] uint8. Strict accuracy, the fraction with every object right, and of
    those the fraction with the relation right."""
    strict = objects = relation = 0
    for prompt, image in zip(prompts, images):
        v = verify(prompt, image)
        strict += v.strict
        if all(ok for name, ok in v.checks.items() if name not in RELATIONS):
            objects += 1
            relation += all(ok for name, ok in v.checks.items() if name in RELATIONS)
    n = len(prompts)
    return {"strict": strict / n, "objects_right": objects / n, "n_objects_right": objects,
            "relation_given_objects": relation / objects if objects else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:shapes", help="a pipeline directory or builtin:shapes")
    ap.add_argument("--prompts", type=int, default=100, help="held-out position prompts")
    ap.add_argument("--seeds", type=int, default=2, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=30000, help="first noise seed")
    ap.add_argument("overrides", nargs="*", help="config overrides of the default preset (model.device=cuda, ...)")
    ap.add_argument("--smoke", action="store_true", help="the code path on a tiny random shapes model (scripts/smoke.py): "
                    "two prompts, one seed, two ODE steps")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.smoke:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from smoke import shapes_overrides, tiny_shapes_model

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="probe_relations-smoke-")))
            args.model = str(tiny_shapes_model(tmp / "model"))
            args.overrides = [*shapes_overrides(args.model), *args.overrides]
            args.prompts, args.seeds = 2, 1
        return run(args)


def run(args) -> int:
    from flowrl.config import load_config
    from flowrl.errors import UserError
    from flowrl.models import load_policy
    from flowrl.train.images import ode_images

    try:
        cfg = load_config("default", [f"model.path={args.model}", *args.overrides])
        policy = load_policy(cfg.model)
    except UserError as e:
        print(f"probe_relations: {e}", file=sys.stderr)
        return 2
    prompts = eval_set(args.prompts)[-args.prompts:] * args.seeds  # eval_set ends with the position category
    seeds = [args.seed + j for j in range(len(prompts))]
    s = cfg.sampling

    def draw(ps):
        return to_uint8(ode_images(policy, ps, seeds, policy.sigmas(s.eval_num_steps, s.schedule, s.shift), s.batch_size))

    asked, swapped = draw(prompts), draw([swap_relation(p) for p in prompts])
    stats = relation_stats(prompts, asked)
    diff = np.abs(asked.astype(np.int16) - swapped.astype(np.int16)).mean()
    print(f"{args.model}: {len(prompts)} position samples, strict {stats['strict']:.3f}, objects right "
          f"{stats['objects_right']:.3f}, relation right given objects right {stats['relation_given_objects']:.3f} "
          f"(n={stats['n_objects_right']}), same noise with the relation swapped: mean pixel difference {diff:.2f} of 255")
    return 0


if __name__ == "__main__":
    sys.exit(main())
