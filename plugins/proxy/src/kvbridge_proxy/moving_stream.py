"""Live moves: what the proxy keeps of a stream to move it, and the requests that move it.

With `kvbridge proxy --live-moves` (docs/elastic.md) a streamed request whose parameters survive a move (`refusal`) is
sent to its decode with `return_token_ids`, and, when that decode's registry record says where its side channel is,
with a move id M in its `kv_transfer_params`. A `MovingStream` keeps the prompt's token ids and every generated
id forwarded to the client. To move the stream the proxy stops forwarding at an event, closes the upstream (vLLM
aborts the request; the decode's connector offers its blocks under M) and sends another decode `resume_body()`: the
prompt and the forwarded tokens as a token-id completion whose params name M and the first decode's side channel, so
it pulls that KV and computes only the last token. `splice()` turns its events into the client's stream: the first
answer's id, chat deltas for a chat request, usage counted as if one server had answered it all.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

import attrs

from kvbridge.base.errors import ConfigError
from kvbridge.control.params import KVTransferParams

CHAT = "/v1/chat/completions"
# What a resumed `/v1/completions` request keeps of the client's: per-step sampling state that the prompt + generated
# tokens fully determine. Everything else (chat messages and templates, echo, prompt_logprobs, n) is the first
# decode's business or refused.
CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "stream_options",
    "user",
    "priority",
    "cache_salt",
    "return_tokens_as_token_ids",
    "stream_interval",
)
# Keys a delta may carry for the generated ids to spell the whole answer (a reasoning or tool parser's do not).
PLAIN_DELTA = {"role", "content"}


MOVES = ("precopy", "stop-and-copy", "recompute")
# a pre-copied stream is cut right after its next event, or this many seconds after its pre-copy ended (its decode
# may be stuck: then the cut is what frees it)
CUT_AT_EVENT_S = 0.5


@attrs.frozen
class MoveSettings:
    """How a stream moves (docs/elastic.md, "Pre-copy").

    precopy: the next decode pulls the blocks the stream has filled while it keeps running, in up to `stages` stages,
    until at most `tail_tokens` are left at the cut; it then computes that tail (`tail="compute"`: the cut needs
    nothing more of the decode it leaves) or pulls it (`"pull"`). stop-and-copy: all of it is pulled after the cut.
    recompute: the next decode computes it (what replaying the tokens costs). A stage not answered in `stage_timeout_s`
    is given up: the cut then pulls what the stages did not. The streams leaving one decode are cut together: one
    whose stages ended waits, still running where it is, up to `cut_together_s` for the others' stages (0: it does
    not), so that no continuation waits on the next decode behind another stream's pre-copy; and at most
    `cuts_at_once` of them are cut at a time to each next decode, the next once the last one's first event came, so
    that none waits there behind the others' continuations."""

    mode: str = attrs.field(default="precopy")
    tail: str = attrs.field(default="compute", validator=attrs.validators.in_(("compute", "pull")))
    stages: int = 3
    tail_tokens: int = 16
    stage_timeout_s: float = 30.0
    cut_together_s: float = 2.0
    cuts_at_once: int = 1

    @mode.validator
    def _known(self, _attribute: Any, value: str) -> None:
        if value not in MOVES:
            raise ConfigError(f"a stream moves by {' or '.join(MOVES)}, not {value!r}")

    def __attrs_post_init__(self) -> None:
        # Written so that a NaN fails: it compares false with everything, and would wait forever or not at all.
        if not (
            min(self.stages, self.cuts_at_once) >= 1 and self.tail_tokens >= 0 and 0 <= self.cut_together_s < math.inf
        ):
            raise ConfigError(
                f"pre-copy needs stages >= 1, tail_tokens >= 0, cut_together_s from 0 seconds and finite, and "
                f"cuts_at_once >= 1; got {self.stages}, {self.tail_tokens}, {self.cut_together_s}, {self.cuts_at_once}"
            )
        if not 0 < self.stage_timeout_s < math.inf:
            raise ConfigError(f"pre-copy needs a finite stage_timeout_s above 0 seconds; got {self.stage_timeout_s}")


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why this request cannot move to another decode mid-stream (docs/elastic.md, parameters), or None."""
    if body.get("stream") is not True:
        return "not streamed"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "several sequences"
    if body.get("seed") is not None:
        return "seeded: the next decode's generator would restart at the seed"
    if body.get("frequency_penalty") or body.get("presence_penalty"):
        return "frequency/presence penalties count output tokens only"
    if body.get("stop"):
        return "stop strings may span the cut"
    if body.get("bad_words"):
        return "a bad word of several tokens may span the cut"
    if body.get("repetition_detection"):
        return "repetition detection reads output tokens only"
    if body.get("thinking_token_budget") not in (None, -1):
        return "a thinking budget counts output tokens"
    if body.get("watermarking"):
        return "watermarking reads the output's history"
    if body.get("vllm_xargs"):
        return "custom extensions' arguments (vllm_xargs) may keep state over the output"
    structured = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    response_format = body.get("response_format")
    if any(body.get(k) for k in structured) or (response_format and response_format != {"type": "text"}):
        return "structured output keeps a grammar's state"
    if body.get("prompt_embeds") is not None or (path == CHAT and _has_media(body.get("messages"))):
        return "media or embeddings in the prompt: the next decode would get its token ids alone"
    if path == CHAT:
        if body.get("tools") or body.get("functions"):
            return "tool calls are parsed over the whole output"
        if body.get("logprobs") or body.get("top_logprobs") or body.get("logprob_token_ids"):
            return "chat logprobs"
    elif body.get("suffix") is not None:
        return "suffix"
    return None


def _has_media(messages: Any) -> bool:
    """A chat message has a content part other than text (an image, audio, a video, a file)."""
    contents = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    parts = [p for c in contents if isinstance(c, list) for p in c]
    return any(not isinstance(p, dict) or p.get("type") != "text" for p in parts)


def pull_outcome(timing: dict[str, Any]) -> str:
    """What a decode's report of its pull (`kvbridge_timing`: its pull states, over all its ranks) says it did.

    "pulled" when the pull ended done on every rank; "recomputed" when it ended fenced or failed on any (vLLM computed
    what did not load), or when no pull was reported (nothing proves a read)."""
    if "at_failed_ms" in timing or "at_fenced_ms" in timing or "at_done_ms" not in timing:
        return "recomputed"
    return "pulled"


def _choice(event: dict[str, Any]) -> dict[str, Any] | None:
    choices = event.get("choices")
    return choices[0] if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict) else None


@attrs.define(eq=False)
class MovingStream:
    """One client stream the proxy may move: its request, the token ids forwarded so far, its cuts."""

    path: str
    body: dict[str, Any]  # the client's request
    request_id: str = ""  # the client's x-request-id (or the proxy's): names the stream in the log
    move_id: str = attrs.field(factory=lambda: f"kvbridge-move-{uuid.uuid4().hex}")
    prompt: list[int] | None = None
    generated: list[int] = attrs.Factory(list)
    movable: bool = True  # False once an event did not say its tokens, or the decode answered an error
    moves: int = 0
    head: dict[str, Any] = attrs.Factory(dict)  # id, object, created, model of the first answer: every event gets them
    _resumed_at: int = 0  # len(generated) when the current upstream took over: its usage counts from there
    _cut: asyncio.Event = attrs.Factory(asyncio.Event)
    cut_reason: str = ""
    _again_at: float = 0.0  # a cut found no other decode: it goes on where it is, and its cut is made again then
    _cut_soon: asyncio.TimerHandle | None = None  # a pre-copied stream's cut, due at its next event or at this
    prefer: Any = None  # the decode to move to (the rebalancer's pick), if it still takes requests
    move: str | None = None  # how this cut moves it (None: the proxy's setting)
    precopy: asyncio.Task | None = None  # the pre-copy of this cut, while it runs
    staged: bool = False  # its pre-copy's stages ended: it waits for the other streams leaving its decode
    cut_slot: asyncio.Semaphore | None = None  # its next decode's cut slot (`MoveSettings.cuts_at_once`), while held
    precopied: tuple[Any, int] | None = None  # (decode, tokens) this cut's pre-copy left in that decode's cache

    @property
    def limit(self) -> int | None:
        """The client's `max_tokens` (or `max_completion_tokens`), if it set one."""
        limit = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return limit if isinstance(limit, int) else None

    @property
    def spent(self) -> bool:
        """Every token the client asked for was forwarded: nothing is left to move."""
        return self.limit is not None and len(self.generated) >= self.limit

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def mark(self, body: dict[str, Any], identity: KVTransferParams | None) -> dict[str, Any]:
        """The decode request with token ids asked for, and the move id where the decode can be pulled from."""
        out = {**body, "return_token_ids": True}
        if identity is not None:
            out["kv_transfer_params"] = {
                **(body.get("kv_transfer_params") or {}),
                "kvbridge_move_id": self.move_id,
            }
        return out

    def request_cut(self, reason: str, prefer: Any = None, move: str | None = None) -> None:
        """Ask the relay to move this stream at its next event (it does so once the prompt's ids are known)."""
        if self.movable and not self._again_at and not self._cut.is_set() and self.precopy is None:
            self.cut_reason, self.prefer, self.move = reason, prefer, move
            self._cut.set()

    def begin_precopy(self, task: asyncio.Task) -> None:
        """The cut waits while `task` pre-copies; it asks for the cut again when it ends."""
        self.precopy, self.staged = task, False
        self._cut.clear()

    def precopy_pending(self, *, leaving: bool) -> bool:
        """Its pre-copy's stages run, or are to come.

        To come: its cut is asked for, or comes at its next event (`leaving`: its decode takes no requests)."""
        if self.precopy is not None:
            return not self.staged
        return self.movable and self.precopied is None and (leaving or self._cut.is_set()) and not self._again_at

    def end_precopy(self, target: Any, tokens: int) -> None:
        """The pre-copy ended, having left `tokens` in `target`'s cache (0: nothing): cut it to `target` soon.

        Right after its next event (`at_event`), so that the client's gap starts at the cut; at most `CUT_AT_EVENT_S`
        from now."""
        self.precopy = None
        self.precopied = (target, tokens)
        self._cut_soon = asyncio.get_running_loop().call_later(CUT_AT_EVENT_S, self.at_event)

    def at_event(self) -> None:
        """The client has the stream's last event: a cut its pre-copy left for this moment is made now."""
        if self._cut_soon is not None:
            self._cut_soon.cancel()
            self._cut_soon = None
            self._cut.set()

    def release_cut_slot(self) -> None:
        """Its cut is over (moved, failed or not made): the next stream may be cut to that decode."""
        slot, self.cut_slot = self.cut_slot, None
        if slot is not None:
            slot.release()

    @property
    def cut_requested(self) -> bool:
        return self._cut.is_set()

    async def wait_cut(self) -> None:
        await self._cut.wait()

    def stay(self, for_s: float) -> None:
        """No other decode could take it now: it goes on where it is, and its cut is made again in `for_s`.

        Not for good: a health round may take out every other decode for a moment just as an operator drains this one,
        and its streams would stay on it to their end."""
        self._again_at = time.monotonic() + for_s
        self._cut.clear()

    def cut_again(self, *, wanted: bool) -> None:
        """At an event: make a cut that found no other decode again, once its wait is over.

        Only while it is still `wanted` (its decode takes no requests: drained, cordoned, or down)."""
        if self._again_at and time.monotonic() >= self._again_at:
            self._again_at = 0.0
            if wanted and self.movable and self.precopy is None:
                self._cut.set()

    def moved(self) -> None:
        """The stream now comes from another decode: a later cut is a new one."""
        if self._cut_soon is not None:
            self._cut_soon.cancel()
            self._cut_soon = None
        self.moves += 1
        self._resumed_at = len(self.generated)
        self._cut.clear()
        self._again_at = 0.0
        self.cut_reason, self.prefer, self.move, self.precopied = "", None, None, None

    def take(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record one event of the stream's upstream; return it as the client gets it."""
        if "error" in event:
            self.movable = False
            return event
        if not self.head:
            self.head = {k: event[k] for k in ("id", "object", "created", "model") if k in event}
        # the prompt's ids come with the first event (chat: at its top level); the client keeps them if it asked,
        # but never a later decode's, which are the prompt and the tokens it was sent
        keep = self.wants_ids and not self.moves
        prompt = event.get("prompt_token_ids") if keep else event.pop("prompt_token_ids", None)
        choice = _choice(event)
        if choice is None:  # a usage event
            self._usage(event)
            return self._renamed(event)
        prompt = (choice.get("prompt_token_ids") if keep else choice.pop("prompt_token_ids", None)) or prompt
        if self.prompt is None and prompt is not None:
            self.prompt = list(prompt)
        ids = choice.get("token_ids") if self.wants_ids else choice.pop("token_ids", None)
        delta = choice.get("delta")
        plain = not isinstance(delta, dict) or {k for k, v in delta.items() if v is not None} <= PLAIN_DELTA
        if ids is None and (choice.get("text") or (isinstance(delta, dict) and delta.get("content")) or not plain):
            self.movable = False  # tokens the proxy cannot count: it finishes where it is
        elif not plain:
            self.movable = False
        if ids:
            self.generated.extend(ids)
        self._usage(event)
        if self.moves:
            event = self._as_client_path(event)
        return self._renamed(event)

    def _usage(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if self.moves and isinstance(usage, dict) and self.prompt is not None:
            completion = self._resumed_at + int(usage.get("completion_tokens") or 0)
            usage.update(prompt_tokens=len(self.prompt), completion_tokens=completion)
            usage["total_tokens"] = len(self.prompt) + completion

    def _renamed(self, event: dict[str, Any]) -> dict[str, Any]:
        return {**event, **self.head} if self.moves else event

    def _as_client_path(self, event: dict[str, Any]) -> dict[str, Any]:
        """A resumed decode answers `/v1/completions`; a chat client gets `chat.completion.chunk` deltas."""
        if self.path != CHAT:
            return event
        choice = _choice(event) or {}
        text = choice.pop("text", "")
        choice.pop("logprobs", None)
        out = dict(event)
        out["choices"] = [{**choice, "delta": {"content": text} if text else {}, "logprobs": None}]
        return out

    def pull_body(self, source: KVTransferParams, *, lease: str | None = None, tokens: int | None = None) -> dict:
        """A one-token request whose decode pulls this stream's KV from `source`, answered whole with its report.

        `lease`: the lease to read (a pre-copy stage's, else the cut's); `tokens`: the context's first tokens only."""
        body = {**self.resume_body(source, mark=False, lease=lease, tokens=tokens), "stream": False, "max_tokens": 1}
        for key in ("min_tokens", "logprobs", "logprob_token_ids", "stream_options", "return_token_ids"):
            body.pop(key, None)
        return body

    def resume_body(
        self, source: KVTransferParams | None, *, mark: bool, lease: str | None = None, tokens: int | None = None
    ) -> dict[str, Any]:
        """The request that continues this stream on another decode.

        `source`: the decode it left, to pull the KV from (None: the next decode computes it). `mark`: the next
        decode can be moved from too. `lease` and `tokens`: as in `pull_body`."""
        assert self.prompt is not None
        body = {k: self.body[k] for k in CARRIED if k in self.body}
        if self.path != CHAT:
            body |= {k: self.body[k] for k in ("logprobs", "logprob_token_ids") if self.body.get(k) is not None}
        context = self.prompt + self.generated
        body.update(prompt=context[:tokens] if tokens else context, stream=True, return_token_ids=True)
        if self.limit is not None:  # a spent stream is never moved (`spent`): at least one token is left
            body["max_tokens"] = max(1, self.limit - len(self.generated))
        if isinstance(self.body.get("min_tokens"), int):
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        params: dict[str, Any] = {"kvbridge_move_id": self.move_id} if mark or source is not None else {}
        if source is not None:
            pull = attrs.evolve(
                source,
                do_remote_prefill=True,
                kvbridge_move_id=lease or self.move_id,
                remote_num_tokens=len(body["prompt"]) - 1,  # vLLM computes the last token again anyway
                transfer_mode="pull",
            )
            params = pull.to_dict()
        if params:
            body["kv_transfer_params"] = params
        return body
