"""A checkpoint's `generation_config.json`, honoured as vLLM does (`--generation-config auto`): its end-of-text
ids and its sampling defaults.

- `eos_token_id` (one id or a list — Llama 3 names three): every one ends a row, beside the tokenizer's own; an
  id the vocabulary does not have is refused at start.
- `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`: a request's value where the client leaves the
  field out (a request's own value always wins); `do_sample: false` makes the default temperature 0 (greedy), as
  `generate()` reads it.
- `max_new_tokens`: the budget of a request that names none (the setting `max_tokens_default` where an operator
  set it explicitly; within `max_tokens_limit`). `max_length` counts the prompt too and is not a default here
  (vLLM's reading as well).

`generation_config: none` (the setting) ignores the file: the OpenAI defaults (temperature 1, no filters, 16
tokens) and the tokenizer's end-of-text alone. /v1/models reports what is in force (`generation_defaults`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FILE = "generation_config.json"
# the request fields a checkpoint may default, with the bounds the request models check
SAMPLING = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (0, 1_000_000), "min_p": (0.0, 1.0),
            "repetition_penalty": (1e-9, 10.0)}


class GenerationConfigError(ValueError):
    """generation_config.json says something that cannot be served (a line for the operator)."""


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float] = field(default_factory=dict)  # field → default, SAMPLING's fields only
    max_tokens: int | None = None
    source: str | None = None  # the file they came from

    @classmethod
    def read(cls, directory: str | Path, vocab_size: int) -> GenerationDefaults:
        """The directory's generation_config.json (none: no defaults), checked against the vocabulary."""
        path = Path(directory) / FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise GenerationConfigError(f"{path}: not readable JSON ({error})") from None
        if not isinstance(raw, dict):
            raise GenerationConfigError(f"{path}: not a JSON object")
        eos = raw.get("eos_token_id")
        ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
            raise GenerationConfigError(f"{path}: eos_token_id {eos!r} names ids outside the vocabulary "
                                        f"(0..{vocab_size - 1})")
        sampling = {}
        for name, (low, high) in SAMPLING.items():
            value = raw.get(name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise GenerationConfigError(f"{path}: {name} {value!r} is outside what a request may ask "
                                            f"([{low:g}, {high:g}])")
            sampling[name] = int(value) if name == "top_k" else float(value)
        if raw.get("do_sample") is False:  # generate()'s greedy decoding, whatever temperature says
            sampling["temperature"] = 0.0
        budget = raw.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise GenerationConfigError(f"{path}: max_new_tokens {budget!r} is not a positive integer")
        return cls(ids, sampling, budget, str(path))

    def value(self, name: str, asked: bool, given):
        """A request field's value: the client's when it `asked`, else this checkpoint's default, else `given`
        (the request model's own default)."""
        return given if asked or name not in self.sampling else self.sampling[name]

    def describe(self) -> dict:
        return {"source": self.source, "eos_token_ids": list(self.eos_token_ids), **self.sampling,
                **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})}
