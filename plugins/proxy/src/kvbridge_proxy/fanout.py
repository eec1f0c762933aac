"""Batched prompts and `n > 1` through `kvbridge proxy`: one P/D request per choice, answers merged in order.

vLLM answers a batch (a list `prompt`, or `n > 1`) with the first prompt's `kv_transfer_params` only, so a
batch cannot go through prefill and decode as one request. The proxy splits it into parts, each one prompt
and one choice with its own prefill, params and decode, and merges the answers as vLLM would have answered
the batch: choice `i` of prompt `p` is choice `p * n + i`, part `i` samples with `seed + i` (vLLM seeds its
`n` children so), usage counts each prompt's tokens once and every choice's completion tokens.

What cannot be split is refused with a `Refused` naming the field: `n > 1` with greedy sampling (vLLM
refuses it too), `best_of` other than `n` (it ranks candidates across choices), beam search.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

import attrs

MAX_PARTS = 256  # P/D requests one client request may make
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


class Refused(ValueError):
    """The request asks for what the proxy cannot split into P/D requests; `field` names the key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@attrs.frozen
class Part:
    """One P/D request of a client request.

    `body` (one prompt, one choice), its choice `index` in the merged answer, and whether it counts its prompt's tokens
    in the merged usage (the prompt's first choice)."""

    body: dict[str, Any]
    index: int
    counts_prompt: bool


def _int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _prompts(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a batched completion request, or None for one prompt.

    One prompt: a string, token ids, or anything vLLM is left to judge."""
    prompt = body.get("prompt")
    if path != "/v1/completions" or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt  # strings, or lists of token ids: a batch (a flat list of ints is one prompt)
    return None


def split(path: str, body: dict[str, Any], max_parts: int = MAX_PARTS) -> list[Part]:
    """The P/D requests `body` makes: itself alone when it is one prompt and one choice; at most `max_parts`."""
    if body.get("use_beam_search"):
        raise Refused("use_beam_search", "use_beam_search is not supported through the P/D proxy")
    n = body.get("n")
    if n is None:
        n = 1
    elif not _int(n) or n < 1:
        raise Refused("n", f"n must be an integer >= 1, got {n!r:.40}")
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, numbers.Real) and temperature < GREEDY_TEMPERATURE:
        raise Refused("n", f"n must be 1 when using greedy sampling, got {n}.")  # vLLM's own words
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise Refused(
            "best_of",
            f"best_of {best_of!r:.40} is not supported through the P/D proxy (each of the n choices is its own "
            "P/D request): leave it out",
        )
    prompts = _prompts(path, body)
    count = len(prompts or (None,)) * n
    if count > max_parts:
        field = "n" if prompts is None else "prompt"
        raise Refused(field, f"{count} choices (prompts times n) is over the proxy's {max_parts} (--max-parts)")
    if count == 1 and best_of is None:
        return [Part(body, 0, True)]
    seed = body.get("seed")
    parts = []
    for p, prompt in enumerate(prompts or (None,)):
        for i in range(n):
            part = {k: v for k, v in body.items() if k != "best_of"}
            if prompts is not None:
                part["prompt"] = prompt
            if "n" in body:
                part["n"] = 1
            if _int(seed):
                part["seed"] = seed + i  # as vLLM seeds the n children of one request
            parts.append(Part(part, p * n + i, i == 0))
    return parts


def _usage(usages: list[tuple[bool, dict[str, Any]]]) -> dict[str, Any] | None:
    """The usage of the whole batch from the parts' (counts_prompt, usage)."""
    if not usages:
        return None
    prompt = sum(u.get("prompt_tokens") or 0 for counts, u in usages if counts)
    completion = sum(u.get("completion_tokens") or 0 for _, u in usages)
    out = dict(usages[0][1])  # the keys vLLM sent (its nulls included), the counts summed
    out |= {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for counts, u in usages if counts]
    if any(c is not None for c in cached):
        out["prompt_tokens_details"] = {"cached_tokens": sum(c or 0 for c in cached)}
    return out


def response_id(template: Any, request_id: str) -> Any:
    """The merged answer's id, as a colocated server names it.

    vLLM's prefix (`cmpl-`, `chatcmpl-`) and the client's request id."""
    if not isinstance(template, str) or "-" not in template:
        return template
    return f"{template.split('-', 1)[0]}-{request_id}"


def merge_whole(parts: list[Part], answers: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """The non-streamed answer to the whole batch from each part's answer (in `parts`' order)."""
    merged = copy.copy(answers[0])
    choices = []
    for part, answer in zip(parts, answers, strict=True):
        for choice in answer.get("choices") or ():
            choices.append({**choice, "index": part.index})
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    merged["id"] = response_id(merged.get("id"), request_id)
    usage = _usage([(p.counts_prompt, a["usage"]) for p, a in zip(parts, answers) if isinstance(a.get("usage"), dict)])
    if usage is not None:
        merged["usage"] = usage
    return merged


class StreamMerge:
    """Merges the parts' streamed chunks into one stream.

    Each chunk's choices get their part's index; the parts' usage chunks are held back and summed into one, sent before
    the one `[DONE]`."""

    def __init__(self, parts: list[Part], request_id: str) -> None:
        self.parts = parts
        self.request_id = request_id
        self._usages: dict[int, tuple[bool, dict[str, Any]]] = {}
        self._last: dict[str, Any] | None = None  # a usage chunk, the template of the merged one

    def chunk(self, k: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """Part `k`'s chunk as the client gets it, or None when it is held back (a final usage chunk)."""
        choices = event.get("choices")
        if choices == [] and isinstance(event.get("usage"), dict):
            self._usages[k] = (self.parts[k].counts_prompt, event["usage"])
            self._last = event
            return None
        if isinstance(choices, list):
            event = {**event, "choices": [{**c, "index": self.parts[k].index} for c in choices if isinstance(c, dict)]}
        if "id" in event:
            event["id"] = response_id(event["id"], self.request_id)
        return event

    def usage_chunk(self) -> dict[str, Any] | None:
        """The batch's usage chunk, when the parts sent theirs (`stream_options.include_usage`)."""
        if self._last is None:
            return None
        usage = _usage([self._usages[k] for k in sorted(self._usages)])
        return {**self._last, "id": response_id(self._last.get("id"), self.request_id), "usage": usage}
