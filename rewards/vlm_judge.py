"""`vlm_judge`: a vision-language model behind an OpenAI-compatible chat-completions endpoint
(what vLLM and SGLang serve) judges each image against its prompt.

    reward:
      weights: {vlm_judge: 1.0}
      on_invalid: drop            # an answer that holds no score drops the sample (error: stops the run)
      options:
        vlm_judge: {url: "http://gpu-box:8000/v1", model: UnifiedReward-7b-v1.5, mode: score}

Three modes (docs/usage.md, "A VLM judge"):
- `score`: the model writes an assessment that ends with a score; `score_pattern` finds it and the
  reward is score / score_max (UnifiedReward's use in Flow-GRPO and DiffusionNFT: a 1-5 score
  after "Final Score:", divided by 5; the image first, then the text, temperature 0).
- `yes_probability`: the model answers a yes/no question with one token and the reward is the
  probability of "Yes" read from the first position's top log-probabilities (VQAScore's API
  form: exp(logprob) of the token "Yes" exactly; `yes_match: loose` adds every top token that is
  "yes" after stripping and lower-casing, a flowrl variant).
- `edit`: for an edit (`EditPrompt`), the source image, then the edited one, then a question whether the
  instruction was followed and the rest of the source kept, answered like `score` (a 1-5 score after
  "Final Score:", parsed and divided by score_max the same way); `{prompt}` is the edit's instruction.

Each image is one request (in mode edit with its source), sent as PNG resized to `image_size`, a base64
data URL; `concurrency` requests run at once. Timeouts, connection failures and 5xx replies are retried with backoff
(rewards/http.py), then the run stops with one sentence. An answer without a score is NaN,
which `reward.on_invalid` drops or refuses; `unparseable: zero` scores it 0 instead (the
reference code's behaviour). The API key is read from the environment variable `api_key_env`
names, and is never logged or written.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
from PIL import Image

from flowrl.errors import UserError
from rewards.http import check_retry_options, request_with_retries
from rewards.registry import register, source_images
from rewards.simple import to_uint8

log = logging.getLogger(__name__)

MODES = ("score", "yes_probability", "edit")
YES_MATCHES = ("exact", "loose")
UNPARSEABLE = ("invalid", "zero")
# the templates: {prompt} is the image's prompt. The score template asks, in UnifiedReward's manner, for
# alignment and quality and a 1-5 score after "Final Score:"; the question is VQAScore's
SCORE_TEMPLATE = (
    "You are given a text caption and an image generated from it. Judge the image on two criteria: "
    "(1) how well it matches the caption (its objects, their attributes and relations), and "
    "(2) its overall quality (clarity, detail, colour and aesthetics). Explain briefly, then give a "
    "score from 1 to 5 on the last line as 'Final Score: <score>'.\nText Caption: [{prompt}]"
)
YES_TEMPLATE = 'Does this figure show "{prompt}"? Please answer yes or no.'
# the edit template: {prompt} is the edit's instruction; the images come source first, as an editing model reads them
EDIT_TEMPLATE = (
    "You are given two images: the first is a source image, the second an edit of it made by following an instruction. "
    "Judge the edit on two criteria: (1) how well the second image carries out the instruction, and (2) how well it "
    "preserves everything in the source that the instruction does not ask to change (objects, layout, colours, "
    "background, identity), without artefacts. Explain briefly, then give a score from 1 to 5 on the last line as "
    "'Final Score: <score>'.\nEditing Instruction: [{prompt}]"
)
SCORE_PATTERN = r"Final Score:\s*([1-5](?:\.\d+)?)"


@register("vlm_judge", "a vision-language judge behind an OpenAI-compatible endpoint (vLLM, SGLang): a parsed 1-5 score "
          "or P(Yes), or in mode edit a score of the edit against its source image (options: url, model, mode, template, api_key_env, concurrency, timeout, retries)")
class VLMJudge:
    def __init__(self, url: str, model: str, mode: str = "score", template: str | None = None,
                 score_pattern: str = SCORE_PATTERN, score_max: float = 5.0, yes_match: str = "exact",
                 top_logprobs: int = 20, max_tokens: int = 512, image_size: int = 512, concurrency: int = 8,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.5, api_key_env: str = "",
                 unparseable: str = "invalid"):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"vlm_judge url '{url}' must start with http:// or https:// (the server's /v1 base)")
        for name, value, allowed in (("mode", mode, MODES), ("yes_match", yes_match, YES_MATCHES),
                                     ("unparseable", unparseable, UNPARSEABLE)):
            if value not in allowed:
                raise UserError(f"reward.options.vlm_judge.{name} must be one of {', '.join(allowed)}; got '{value}'")
        check_retry_options("vlm_judge", timeout, retries, backoff)
        if concurrency < 1 or image_size < 0 or score_max <= 0 or not 1 <= top_logprobs <= 20 or max_tokens < 1:
            raise UserError("vlm_judge needs concurrency >= 1, image_size >= 0, score_max > 0, top_logprobs in 1-20 and "
                            f"max_tokens >= 1; got {concurrency}, {image_size}, {score_max}, {top_logprobs}, {max_tokens}")
        self.template = template if template is not None else {"score": SCORE_TEMPLATE, "yes_probability": YES_TEMPLATE,
                                                                  "edit": EDIT_TEMPLATE}[mode]
        if "{prompt}" not in self.template:
            raise UserError("reward.options.vlm_judge.template must contain {prompt}, where each image's prompt (in mode edit: "
                            "its instruction) goes")
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as exc:
            raise UserError(f"reward.options.vlm_judge.score_pattern is not a regular expression ({exc})") from None
        if self.pattern.groups < 1:
            raise UserError("reward.options.vlm_judge.score_pattern needs one group around the number")
        self.api_key = ""
        if api_key_env:
            self.api_key = os.environ.get(api_key_env, "")
            if not self.api_key:
                raise UserError(f"reward.options.vlm_judge.api_key_env names ${api_key_env}, which is not set")
        self.url, self.model, self.mode = url.rstrip("/"), model, mode
        self.score_max, self.yes_match, self.top_logprobs, self.max_tokens = float(score_max), yes_match, top_logprobs, max_tokens
        self.image_size, self.concurrency, self.unparseable = image_size, concurrency, unparseable
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        urls = [self._data_url(pixels) for pixels in to_uint8(images)]
        texts, source_urls = list(prompts), [None] * len(urls)
        if self.mode == "edit":
            # the judge fetches the sources itself rather than naming `sources` in its signature: the registry would then
            # demand them in every mode (rewards/registry.py as_reward); source_images refuses a plain prompt in one sentence
            source_urls = [self._data_url(pixels) for pixels in to_uint8(source_images("vlm_judge", prompts, images))]
            texts = [p.instruction for p in prompts]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(urls)) or 1) as pool:
            scores = list(pool.map(self._judge, urls, texts, source_urls))
        return torch.tensor(scores, dtype=torch.float32)

    def _data_url(self, pixels) -> str:
        image = Image.fromarray(pixels)
        if self.image_size and image.size != (self.image_size, self.image_size):
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

    def request_body(self, data_url: str, prompt: str, source_url: str | None = None) -> dict:
        """The chat-completions request for one image: the image (after its source, in mode edit), then the question,
        greedy."""
        images = [source_url, data_url] if source_url is not None else [data_url]
        content = [*({"type": "image_url", "image_url": {"url": url}} for url in images),
                   {"type": "text", "text": self.template.replace("{prompt}", prompt)}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0.0}
        if self.mode == "yes_probability":
            body.update(max_tokens=1, logprobs=True, top_logprobs=self.top_logprobs)
        else:
            body.update(max_tokens=self.max_tokens)
        return body

    def _judge(self, data_url: str, prompt: str, source_url: str | None = None) -> float:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        reply = request_with_retries("POST", self.url + "/chat/completions", f"vlm_judge server {self.url}",
                                     "start the server (vLLM or SGLang) or fix reward.options.vlm_judge.url", self.timeout,
                                     self.retries, self.backoff, json=self.request_body(data_url, prompt, source_url), headers=headers)
        try:
            choice = reply.json()["choices"][0]
        except Exception:
            raise UserError(f"vlm_judge server {self.url} sent a reply that is not a chat completion") from None
        if self.mode == "yes_probability":
            return self.yes_probability(choice)
        return self.parse_score((choice.get("message") or {}).get("content") or "")

    def yes_probability(self, choice: dict) -> float:
        """P("Yes") at the answer's first token, from its top log-probabilities."""
        try:
            top = choice["logprobs"]["content"][0]["top_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"vlm_judge server {self.url} returned no log-probabilities; mode yes_probability needs a "
                            "server that honours logprobs and top_logprobs (vLLM, SGLang)") from None
        if self.yes_match == "exact":
            return sum(math.exp(t["logprob"]) for t in top if t.get("token") == "Yes")
        return sum(math.exp(t["logprob"]) for t in top if str(t.get("token", "")).strip().lower() == "yes")

    def parse_score(self, text: str) -> float:
        """score / score_max from the answer, or NaN (or 0 under `unparseable: zero`) without one."""
        found = self.pattern.search(text)
        if found:
            try:
                return float(found.group(1)) / self.score_max
            except ValueError:
                pass
        if self.unparseable == "zero":
            return 0.0
        snippet = " ".join(text.split())[:120]
        log.warning("vlm_judge: no score in the answer %r (score_pattern %s); the image is invalid", snippet, self.pattern.pattern)
        return math.nan

