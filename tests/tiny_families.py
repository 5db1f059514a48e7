"""Every model family's tiny pipeline (tests/conftest.py's fixtures) with the overrides of a short run on it,
for the tests that sweep the families: `flowrl export`'s printed code and `flowrl check`."""

from __future__ import annotations

# model.kind -> (the fixture of its tiny pipeline, its own overrides)
TINY_FAMILIES = {
    "sd3": ("tiny_sd3_dir", ["model.guidance_scale=4.5"]),
    "flux": ("tiny_flux_dir", ["model.guidance_scale=3.5"]),
    "flux2": ("tiny_flux2_dir", ["model.guidance_scale=4.0"]),
    "flux2_klein": ("tiny_flux2_klein_dir", ["model.guidance_scale=4.0"]),
    "qwen_image": ("tiny_qwen_image_dir", ["model.guidance_scale=4.0"]),
    "z_image": ("tiny_z_image_dir", ["model.guidance_scale=3.0"]),
    "sana": ("tiny_sana_dir", ["model.guidance_scale=4.5"]),
    "wan": ("tiny_wan_dir", ["model.guidance_scale=5.0", "model.num_frames=5", "model.height=32", "model.width=32"]),
}


def tiny_family_args(kind: str, request, schedule: str) -> list[str]:
    """The tiny JPEG preset on `kind`'s tiny pipeline: 2 samples of 1 prompt, 2 training and 3 sampling
    steps on sampling.schedule `schedule`, a rank-4 LoRA on the attention projections every family has, and
    the brightness reward (two tiny samples often compress to JPEGs of one size: a group with no signal)."""
    fixture, own = TINY_FAMILIES[kind]
    return ["tiny_jpeg", f"model.kind={kind}", f"model.path={request.getfixturevalue(fixture)}", "model.max_sequence_length=64",
            f"sampling.schedule={schedule}", "sampling.num_steps=2", "sampling.eval_num_steps=3", "sampling.batch_size=2",
            "data.group_size=2", "data.prompts_per_iteration=1", "lora.rank=4", "lora.alpha=8",
            "lora.target_modules=[to_q,to_k,to_v,to_out.0]", "reward.weights={brightness: 1.0}", *own]

# the grid each family samples on in the export test (tests/sampling/test_pipeline_fidelity.py); the check test
# (tests/train/test_check.py) takes the other one, so that every family's pipeline call is tried on both
EXPORT_SCHEDULES = {"sd3": "pipeline", "flux": "shifted_linear", "flux2": "shifted_linear", "flux2_klein": "pipeline",
                    "qwen_image": "shifted_linear", "z_image": "pipeline", "sana": "pipeline", "wan": "shifted_linear"}


def check_schedule(kind: str) -> str:
    return "pipeline" if EXPORT_SCHEDULES[kind] == "shifted_linear" else "shifted_linear"
