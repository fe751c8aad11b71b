"""Continuous batching: requests join and leave one running decode batch at step boundaries.

Each :meth:`Scheduler.step` reads a chunk of prompt tokens, oldest request first, then runs
one decode step of the batch. A chunk costs what ``prefill_chunk`` tokens cost at the start
of a prompt: fewer tokens as its caches fill (:mod:`qfserve.engine.serving.chunking`). A long
prompt is read one chunk per step; prompts that end within what the step has left are read in
the same step (one forward pass each, on their own caches), so a burst of short requests does
not join one step apart.
Every prompt is cut into the same blocks as when it is alone (a prompt is never started with
less than a chunk unless it ends there). Newcomers therefore stall the running streams for one
chunk's cost at most, and each joins the batch when its prompt is done.

Decoding reuses mlx-lm's ``GenerationBatch`` (per-request samplers, logits processors, EOS
matching and ``max_tokens``; ``filter``/``extend`` as requests leave and join), as
:class:`~qfserve.engine.serving.decoding.DecodeBatch` (its vocabulary normalised natively), over
:class:`qfserve.engine.kv.batch.BatchCache`, which keeps each request's own eviction caches. Prompts are
prefilled here, one request at a time on its own caches, rather than by mlx-lm's
``PromptProcessingBatch``: that one right-pads a batch of prompts into shared batch caches
and rolls the padding away afterwards (``prepare``/``finalize``), which an eviction cache
that drops rows during the prompt cannot follow. What is left per request (streaming
detokenization, stop strings, logprobs, cancellation, the client's backlog) is the
:class:`Sequence` below.

Everything here runs on the worker thread that owns the model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream, make_stop_sequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.models.memory import release_memory
from qfserve.engine.serving.chunking import ChunkCost, chunk_limit
from qfserve.engine.serving.decoding import DecodeBatch
from qfserve.engine.serving.detail import kv_cache_detail
from qfserve.engine.serving.jobs import Departure, KeptTurn
from qfserve.engine.text.prompts import StopText, token_logprobs
from qfserve.engine.text.requests import Delta, Failed, Finished, FinishReason
from qfserve.engine.text.sampling import request_sampler

if TYPE_CHECKING:
    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.kv.methods import Policy, Work
    from qfserve.engine.models.loading import LoadedModel
    from qfserve.engine.serving.jobs import Admission, Job
    from qfserve.engine.serving.records import RequestRecord, State

logger = logging.getLogger(__name__)

STATS_EVERY = 8  # decode steps between cache-stat refreshes of an active record


@dataclass
class Sequence:
    """One admitted request: its prompt, its caches and its streaming state."""

    job: Job
    prompt: list[int]
    max_tokens: int
    cache: CacheConfig  # the settings it runs with
    caches: list[Any]
    policy: Policy  # what its method does beyond a score (qfserve.engine.kv.methods)
    detokenizer: Any
    stop: StopText | None
    read: int = 0  # prompt tokens the caches hold so far (a reused cache starts with some)
    tokens: int = 0  # tokens generated so far (EOS included)
    uid: int = -1
    cached: int = 0  # prompt tokens a reused cache already held
    generated: list[int] = field(default_factory=list)
    work: Work | None = None  # the method's work under way, stepped as prefill chunks are

    @property
    def record(self) -> RequestRecord:
        return self.job.record


class Scheduler:
    """The prefill queue and the decode batch of one model.

    It owns every admitted request from :meth:`add` until it leaves; :meth:`step` hands
    back those that left (:class:`Departure`), with the turn to keep where it ended normally.

    Args:
        loaded: The model and tokenizer.
        keeps: Turns that end normally and ask for reuse are handed back with their caches
            (after their method's :meth:`qfserve.engine.kv.methods.Policy.before_keep`).
        max_backlog: Events a client may leave untaken before it is cancelled (``None``: not
            checked here; under lockstep the leader's worker checks it between steps).
        prefill_chunk: Prompt tokens per prefill step at the start of a prompt; fewer as
            its caches fill, at the same cost (:mod:`qfserve.engine.serving.chunking`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        keeps: bool = False,
        max_backlog: int | None,
        prefill_chunk: int,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.loaded = loaded
        self._keeps = keeps
        self._departed: list[Departure] = []
        self._max_backlog = max_backlog
        self.prefill_chunk = prefill_chunk
        self._cost = ChunkCost.of(loaded)
        self._prefilling: deque[Sequence] = deque()
        self._batch = self._empty_batch()
        self._decoding: dict[int, Sequence] = {}
        self._uids = 0

    def _empty_batch(self) -> DecodeBatch:
        return DecodeBatch.empty(self.loaded.model, make_sampler(0.0))

    def __len__(self) -> int:
        """Requests admitted and not finished (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    def sequences(self) -> list[Sequence]:
        return [*self._prefilling, *self._decoding.values()]

    def add(self, admission: Admission) -> None:
        """Admit a prepared request whose ``Started`` was sent."""
        job, stop = admission.job, admission.job.request.sampling.stop
        self._prefilling.append(
            Sequence(
                job=job,
                prompt=admission.prompt,
                max_tokens=admission.max_tokens,
                cache=admission.cache,
                caches=admission.caches,
                policy=admission.policy,
                detokenizer=self.loaded.tokenizer.detokenizer,
                stop=StopText(stop) if stop else None,
                read=admission.cached,
                cached=admission.cached,
            )
        )
        job.record.state = "prefill"

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[Departure]:
        """Up to ``prefill_chunk`` prompt tokens (if prompts wait), then one decode step;
        returns the requests that left during it."""
        with mx.stream(generation_stream):
            self._drop_cancelled()
            full = self.prefill_chunk
            left = float(full)  # the step's prompt tokens, counted at an empty cache's cost
            while self._prefilling:
                seq = self._prefilling[0]
                weight = self._cost.weight(seq.caches)
                limit = chunk_limit(weight, left, full)
                if left < full and len(seq.prompt) - 1 - seq.read > limit:
                    # Only a prompt that ends within what is left joins this step: one cut
                    # elsewhere would be chunked unlike alone (and some caches' kept rows
                    # depend on the chunking). It starts the next step.
                    break
                left -= self._prefill_chunk(seq, limit) * weight
                if self._prefilling and self._prefilling[0] is seq:
                    break  # still reading: the step's tokens are spent
            if self._decoding:
                self._decode()
            if not self:
                # Nothing left: no MLX work may outlive its requests (a removed member's
                # next token was queued by async_eval), nor any array (the last step's
                # tokens and logprobs), and freed buffers go back.
                self._batch = self._empty_batch()
                release_memory(after=generation_stream)
        departed, self._departed = self._departed, []
        return departed

    def _prefill_chunk(self, seq: Sequence, limit: int) -> int:
        """Read up to ``limit`` more of the oldest prompt, or step its method's work (it joins
        the batch once both are done, or leaves the queue failed); returns the tokens spent."""
        n = 0
        try:
            todo = len(seq.prompt) - 1 - seq.read  # the last token starts the decoding
            work = seq.work
            if work is not None:  # its tokens count as a prefill chunk's do
                n = work.step(limit)
                if not work.done:
                    return n
                seq.work = None
            elif todo > 0:
                # No one-token chunk: a decode step to the caches (a pass's prompt: cut)
                n = todo if todo - min(limit, todo) == 1 else min(limit, todo)
                chunk = mx.array(seq.prompt[seq.read : seq.read + n])[None]
                self.loaded.model(chunk, cache=seq.caches)
                mx.eval([c.state for c in seq.caches])
                seq.read += n
                todo -= n
                if todo > 0:
                    seq.work = seq.policy.after_read(seq.prompt[: seq.read])
            if todo > 0:
                return n
            work = seq.work = seq.policy.before_decode(seq.prompt[:-1])
            if work is not None:
                n += work.step(limit - n)
                if not work.done:
                    return n
                seq.work = None
            self._prefilling.popleft()
            self._join(seq)
        except Exception as exc:  # noqa: BLE001 - one request failing must not stop the others
            if self._prefilling and self._prefilling[0] is seq:
                self._prefilling.popleft()
            self._fail(seq, exc)
        return n

    def _join(self, seq: Sequence) -> None:
        """The prompt is read: the last prompt token starts the request's decoding."""
        sp = seq.job.request.sampling
        processors = make_logits_processors(
            dict(sp.logit_bias) or None,
            repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 1 else None,
            presence_penalty=sp.presence_penalty or None,
            frequency_penalty=sp.frequency_penalty or None,
        )
        if seq.job.request.constraint is not None:
            from qfserve.engine.text.structured import GrammarProcessor

            processors.append(GrammarProcessor(self.loaded.tokenizer, seq.job.request.constraint))
        seq.uid, self._uids = self._uids, self._uids + 1
        sampler = request_sampler(sp)
        newcomer = DecodeBatch(
            self.loaded.model,
            [seq.uid],
            mx.array(seq.prompt[-1:]),
            [BatchCache([c]) for c in seq.caches],
            [list(seq.prompt[:-1])],  # what the caches hold; the first step adds the last
            [sampler],
            sampler,
            [processors],
            [make_stop_sequences(self.loaded.tokenizer)],
            [seq.max_tokens],
        )
        seq.read = len(seq.prompt)
        seq.record.state = "decode"
        self._batch.extend(newcomer)
        self._decoding[seq.uid] = seq

    def _decode(self) -> None:
        try:
            responses = self._batch.next()
        except Exception as exc:  # noqa: BLE001 - the batch's step failed: fail its members
            logger.exception("a decode step failed")
            members = list(self._decoding.values())
            self._decoding.clear()
            self._batch.filter([])
            for seq in members:
                self._fail(seq, exc, logged=True)
            return
        leaving: list[int] = []
        finished: list[tuple[Sequence, Finished, str | None]] = []
        for r in responses:
            seq = self._decoding[r.uid]
            try:
                done = self._emit(seq, r.token, r.logprobs, r.finish_reason)
                if done is None:
                    seq.policy.after_step(seq.tokens)
            except _Leave as leave:
                leaving.append(r.uid)
                self._leave(seq, leave.state, leave.event)
                continue
            except Exception as exc:  # noqa: BLE001 - this member only
                leaving.append(r.uid)
                self._decoding.pop(r.uid)
                self._fail(seq, exc)
                continue
            if done is not None:
                self._decoding.pop(r.uid)
                leaving.append(r.uid)  # a stop string: still in mlx-lm's batch
                finished.append((seq, done, r.finish_reason))
        if leaving:
            self._remove(leaving)  # packed members get their rows back: detail reads them
        for seq, done, reason in finished:
            seq.job.emit(self._detailed(seq, done))  # before the turn's last word on them
            turn = self._turn(seq, reason)
            self._departed.append(Departure(seq.record, "done", turn))

    def _detailed(self, seq: Sequence, done: Finished) -> Finished:
        """``done`` with what its caches hold where the request asked; the answer stands
        without it should that fail."""
        request = seq.job.request
        if not request.detail:
            return done
        try:
            detail = kv_cache_detail(seq.caches, seq.prompt, self.loaded.tokenizer, request)
        except Exception:  # noqa: BLE001 - answered already
            logger.exception("request %s: its kv_cache_detail failed", seq.job.id)
            return done
        return dataclasses.replace(done, kv_detail=detail)

    def _emit(
        self, seq: Sequence, token: int, logprobs: mx.array, finish: str | None
    ) -> Finished | None:
        """Stream one generated token; the request's ``Finished`` once it ends."""
        seq.tokens += 1
        seq.generated.append(token)
        record, sp = seq.record, seq.job.request.sampling
        record.completion_tokens = seq.tokens
        if seq.tokens % STATS_EVERY == 1:
            record.update(seq.caches)
        if finish != "stop":  # EOS is not text
            seq.detokenizer.add_token(token)
        if finish is not None:
            seq.detokenizer.finalize()
        piece = seq.detokenizer.last_segment
        text, stopped = seq.stop.feed(piece) if seq.stop else (piece, False)
        reason: FinishReason | None = None
        if finish is not None and not stopped:
            reason = cast(FinishReason, finish)  # mlx-lm sets only "stop" and "length"
            if seq.stop:
                text += seq.stop.flush()
        if stopped:
            reason = "stop"
        lp = _Token(token, logprobs)
        logged = token_logprobs(self.loaded.tokenizer, lp, sp.top_logprobs) if sp.logprobs else ()
        if text or logged:
            seq.job.emit(Delta(text, logged))
            if self._max_backlog is not None and seq.job.backlog > self._max_backlog:
                logger.warning("request %s: its client stopped reading; cancelled", seq.job.id)
                seq.job.cancel(Failed("cancelled", "the client stopped reading the stream"))
                raise _Leave("cancelled", seq.job.failure)
        if reason is None:
            return None
        record.update(seq.caches)
        return Finished(
            finish_reason=reason,
            prompt_tokens=len(seq.prompt),
            completion_tokens=seq.tokens,
            kv_cache=record.kv_cache(seq.cache, seq.job.request.budget_source),
            cached_tokens=seq.cached,
        )

    def _turn(self, seq: Sequence, finish_reason: str | None) -> KeptTurn | None:
        """What a finished request leaves for its next turn: only one ended by EOS or
        max_tokens, whose caches hold every token the client got (a stop string cuts what
        it gets), after its method's last word on them (:meth:`Policy.before_keep`); should
        that fail, the answer stands and only the turn is lost."""
        if not (self._keeps and seq.job.request.reuse and finish_reason is not None):
            return None
        tokens = [*seq.prompt, *seq.generated]
        try:
            seq.policy.before_keep(tokens)
        except Exception:  # noqa: BLE001 - answered already
            logger.exception("request %s: its turn could not be kept", seq.job.id)
            return None
        return KeptTurn(seq.job.request, seq.cache, tokens, seq.caches)

    # -- leaving -------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._prefilling if s.job.cancelled]:
            self._prefilling.remove(seq)
            self._leave(seq, "cancelled", seq.job.failure)
        gone = [uid for uid, s in self._decoding.items() if s.job.cancelled]
        for uid in gone:
            seq = self._decoding.pop(uid)
            self._leave(seq, "cancelled", seq.job.failure)
        if gone:
            self._remove(gone)

    def _remove(self, uids: list[int]) -> None:
        """Take these members out of mlx-lm's batch (its caches with them)."""
        gone = set(uids)
        keep = [i for i, uid in enumerate(self._batch.uids) if uid not in gone]
        if len(keep) < len(self._batch.uids):
            if not keep:  # mlx-lm drops its caches unfiltered: members get their rows first
                for cache in self._batch.prompt_cache:
                    cache.filter([])
            self._batch.filter(keep)

    def _leave(self, seq: Sequence, state: State, event: Failed | None) -> None:
        self._decoding.pop(seq.uid, None)
        seq.job.emit(event or Failed("cancelled", "the request was cancelled"))
        self._departed.append(Departure(seq.record, state))

    def _fail(self, seq: Sequence, exc: BaseException, *, logged: bool = False) -> None:
        if not logged:
            logger.exception("request %s failed", seq.job.id)
        seq.job.emit(Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))
        self._departed.append(Departure(seq.record, "error"))

    def clear(self) -> None:
        """Forget every admitted request (the worker is stopping and tells their clients)."""
        self._departed.clear()
        self._prefilling.clear()
        self._decoding.clear()
        self._batch = self._empty_batch()


class _Leave(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, state: State, event: Failed | None) -> None:
        self.state, self.event = state, event


@dataclass
class _Token:
    """What :func:`qfserve.engine.text.prompts.token_logprobs` reads of a generated token."""

    token: int
    logprobs: mx.array
