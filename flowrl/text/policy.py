"""A causal language model as the policy: `AutoModelForCausalLM` and `AutoTokenizer` from a hub
id or a local directory, a LoRA through peft or full fine-tuning, and the reference policy (the
adapter disabled, or under full fine-tuning a frozen copy made only when the KL needs one)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from flowrl.errors import UserError
from flowrl.devices import DTYPES, pick_device
from flowrl.hub import check_hub_id
from flowrl.text.config import TextConfig, TextGenerationConfig, TextLoraConfig, TextModelConfig
from flowrl.text.generate import Generation, generate, sequence_log_probs


def builtin_text_dir(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / f"{name}-llama"


def resolve_text_path(path: str) -> str:
    if path.startswith("builtin:"):
        target = builtin_text_dir(path.removeprefix("builtin:"))
        if not (target / "config.json").is_file():
            raise UserError(f"model.path '{path}' is not installed with this flowrl ({target} is missing)")
        return str(target)
    local = Path(path).expanduser()
    return str(local) if local.exists() else path


class CausalLMPolicy:
    def __init__(self, model, tokenizer, cfg: TextModelConfig, device: torch.device):
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device
        if tokenizer.pad_token_id is None:  # many chat models ship without one
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"  # prompts end together, completions start together
        self.has_lora = False
        self._reference = None

    @classmethod
    def from_config(cls, cfg: TextModelConfig, device: torch.device | None = None) -> "CausalLMPolicy":
        """The model and tokenizer of `cfg.path` on `device` (default: model.device)."""
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()
        path = resolve_text_path(cfg.path)
        if not Path(path).exists():  # a hub id: one sentence within seconds if it cannot be fetched
            check_hub_id(path, "config.json")
        device = device or pick_device(cfg.device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype])
        except (OSError, ValueError) as exc:
            raise UserError(f"model.path '{cfg.path}' could not be loaded as a causal language model: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        return cls(model.to(device).eval(), tokenizer, cfg, device)

    # ---- training setups ---------------------------------------------------------------
    def add_lora(self, lora: TextLoraConfig, seed: int = 0) -> None:
        from peft import LoraConfig, get_peft_model

        names = [n for n, _ in self.model.named_modules()]
        unknown = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            raise UserError(f"lora.target_modules names modules that {type(self.model).__name__} lacks: {', '.join(unknown)}")
        torch.manual_seed(seed)
        self.model = get_peft_model(self.model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                                                           lora_dropout=0.0, task_type="CAUSAL_LM"))
        for p in self.trainable_parameters().values():
            p.data = p.data.float()
        self.has_lora = True

    def enable_full_finetune(self, keep_reference: bool) -> None:
        if keep_reference:
            self._reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.model.requires_grad_(True)

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: the adapter disabled, or the frozen copy."""
        if self.has_lora:
            with self.model.disable_adapter():
                yield self.model
        elif self._reference is not None:
            yield self._reference
        else:
            raise UserError("the reference policy needs lora.enabled=true or trainer.kl_beta > 0 (which keeps a frozen copy)")

    # ---- sampling and scoring -------------------------------------------------------------
    def format(self, prompts: list[str]) -> list[str]:
        """The prompts as the model reads them: in its chat template when it has one."""
        if not (self.cfg.chat_template and getattr(self.tokenizer, "chat_template", None)):
            return list(prompts)
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in prompts]

    def generate(self, prompts: list[str], seeds: list[int], g: TextGenerationConfig, greedy: bool = False) -> Generation:
        was_training = self.model.training
        self.model.eval()
        try:
            return generate(self.model, self.tokenizer, self.format(prompts), seeds, g.max_new_tokens,
                            0.0 if greedy else g.temperature, g.top_p, tuple(g.stop), g.batch_size)
        finally:
            self.model.train(was_training)

    def log_probs(self, gen: Generation, rows, temperature: float, model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [n, T] of `rows` of a generation (with grad)."""
        return sequence_log_probs(model or self.model, gen.prompt_ids[rows], gen.prompt_mask[rows], gen.completion_ids[rows],
                                  gen.completion_mask[rows], temperature)

    # ---- saving ---------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """The adapter (`PeftModel.from_pretrained(base, directory)`) or the whole model and its
        tokenizer (`AutoModelForCausalLM.from_pretrained(directory)`), in safetensors."""
        self.model.save_pretrained(str(directory), safe_serialization=True)
        if not self.has_lora:
            self.tokenizer.save_pretrained(str(directory))

    def load_trained(self, directory: Path) -> None:
        """Weights a run saved with `save`, into this (base) policy."""
        if (Path(directory) / "adapter_config.json").is_file():
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, str(directory)).to(self.device).eval()
            self.has_lora = True
        else:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=DTYPES[self.cfg.dtype]).to(self.device).eval()


def load_text_policy(cfg: TextConfig, trainable: bool = True, device: torch.device | None = None, reference: bool = True) -> CausalLMPolicy:
    """The policy as the text trainer builds it: its LoRA (seeded by trainer.seed) or full fine-tuning,
    with the frozen reference copy the KL needs unless `reference` is False."""
    policy = CausalLMPolicy.from_config(cfg.model, device=device)
    if trainable:
        if cfg.lora.enabled:
            policy.add_lora(cfg.lora, seed=cfg.trainer.seed)
        else:
            policy.enable_full_finetune(keep_reference=reference and cfg.trainer.kl_beta > 0)
    return policy
