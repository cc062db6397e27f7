"""After the forward: verify every request at its frontier, commit tokens, check stops, keep stats.

A plain step is the K = 0 case of the same verify (workers/rejection_sampler.py). Committing rolls
the request's KV length back to the accepted prefix (just a number), detokenizes, and applies EOS,
stop strings and max_tokens; a finished request is handed to ``finish``, which frees its slot.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

import torch

from workers.grammar import GrammarRuntime
from workers.logprobs import token_logprobs
from workers.native_attention import RowRaces
from workers.penalties import penalize_rows
from workers.proposers.base import Proposer
from workers.rejection_sampler import verify, verify_coupled
from workers.request import Request, RequestOutput, Status, StepEvent, TokenLogprob
from workers.sampler import position_key, row_races
from workers.stats import AcceptanceTracker, SpecDecodeStats


@dataclass
class FrontierRow:
    """A request whose step ends at its frontier: it decides output tokens this step."""

    request: Request
    fed: list[int]  # tokens fed this step (pending token + drafts, or the prompt's last chunk)
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), vocab] q rows (rejection verification only)
    num_forced: int = 0  # the leading drafts the grammar forced (structured output), not a proposer's


@dataclass
class OutputCounters:
    """Cumulative since start, published in every snapshot (a reader takes rates from two snapshots)."""

    output_tokens: int = 0
    spec_request_steps: int = 0  # decode request-steps that verified drafts
    plain_request_steps: int = 0  # decode request-steps without drafts


class OutputProcessor:
    def __init__(
        self,
        verification: Literal["coupled", "rejection"],
        max_model_len: int,
        proposers: dict[str, Proposer],
        finish: Callable[[Request, str], None],
        on_verify: Callable[[str, int, int], None] | None = None,
        grammars: GrammarRuntime | None = None,
    ) -> None:
        self.verification = verification
        self.max_model_len = max_model_len
        self.proposers = proposers
        self.finish = finish
        self.on_verify = on_verify  # (proposer, num_draft, num_accepted) per speculative verify: metrics
        self.grammars = grammars  # masks the rows of requests with structured output
        self.stats: dict[str, SpecDecodeStats] = collections.defaultdict(SpecDecodeStats)
        self.acceptance = AcceptanceTracker()  # per proposer, what the goodput policy reads
        self.counters = OutputCounters()

    def process(
        self,
        rows: list[FrontierRow],
        logits: torch.Tensor,  # [sum_i (len(drafts_i) + 1), vocab] the frontier rows, in order
        event: tuple[int, int] | None = None,  # (step start, proposers done) in time.time_ns(), when recording
        argmax: list[int] | None = None,  # [rows] logits.argmax(dim=-1).tolist(), where the forward found it
    ) -> list[RequestOutput]:
        row_start = list(itertools.accumulate((len(f.drafts) + 1 for f in rows), initial=0))[:-1]
        chosen = self._masked(self._penalized(logits, rows, row_start), rows, row_start)
        if self.verification == "coupled":
            result = verify_coupled(
                chosen,
                [f.drafts for f in rows],
                [f.request.params for f in rows],
                [self._row_keys(f.request, len(f.drafts)) for f in rows],
                argmax if chosen is logits else None,  # rows penalized or masked have their own argmax
            )
        else:
            result = verify(
                chosen,
                [f.drafts for f in rows],
                [f.draft_probs for f in rows],
                [f.request.params for f in rows],
                [f.request.generator for f in rows],
            )
        outputs: list[RequestOutput] = []
        for f, start, new_ids, n_acc in zip(rows, row_start, result.output_token_ids, result.num_accepted):
            r, n_draft = f.request, len(f.drafts)
            kind = "prefill" if r.in_prefill else ("spec" if n_draft else "plain")
            if event is not None and r.events is not None:
                r.events.append(StepEvent(event[0], time.time_ns(), kind, n_draft, n_acc, event[1]))
            self.counters.spec_request_steps += kind == "spec"
            self.counters.plain_request_steps += kind == "plain"
            r.num_computed += len(f.fed) - (n_draft - n_acc)  # KV of rejected drafts is now stale: length moves back
            self._record(r, n_draft, n_acc, f.num_forced)
            lps = (
                None
                if r.params.logprobs is None
                else token_logprobs(logits[start : start + len(new_ids)], new_ids, r.params.logprobs)
            )  # the raw rows, not penalized
            outputs.append(self.commit(r, new_ids, lps))
            if r.grammar is not None and r.status is not Status.FINISHED and self.grammars is not None:
                t0 = time.perf_counter()
                r.grammar.consume(outputs[-1].token_ids)
                self.grammars.seconds += time.perf_counter() - t0
            self.counters.output_tokens += len(outputs[-1].token_ids)
        return outputs

    @staticmethod
    def _row_keys(r: Request, num_draft: int, ahead: int = 0) -> list[int]:
        """Noise keys of the output positions a verify of ``num_draft`` drafts decides (none if greedy), ``ahead``
        positions past the committed output (a run of steps with no commit between them)."""
        if r.params.greedy:
            return []
        t0 = len(r.output_ids) + ahead
        return [position_key(r.seed, t0 + j) for j in range(num_draft + 1)]

    def _record(self, r: Request, n_draft: int, n_acc: int, n_forced: int = 0) -> None:
        r.spec.record_verify(n_draft, n_acc)
        if n_forced:
            r.spec.record_grammar(n_forced, n_acc)
            self.stats["grammar"].record_verify(n_forced, min(n_forced, n_acc))
            # the proposer's own drafts follow the forced ones: its stats see only those
            n_draft, n_acc = n_draft - n_forced, max(0, n_acc - n_forced)
        if not r.proposer:
            return
        stats = self.stats[r.proposer]
        if n_draft:
            stats.record_verify(n_draft, n_acc)
            self.acceptance.on_verify(r.proposer, n_draft, n_acc)
            self.proposers[r.proposer].observe(r.request_id, n_draft, n_acc)
            if self.on_verify is not None:
                self.on_verify(r.proposer, n_draft, n_acc)
        else:
            stats.plain_steps += 1

    def _masked(
        self,
        logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] the rows tokens are chosen from
        rows: list[FrontierRow],
        row_start: list[int],  # per frontier request: its first row
    ) -> torch.Tensor:
        """Structured output: each constrained request's row j masked to what its grammar allows after its
        committed tokens and drafts[:j] (workers/grammar.py); the other rows are untouched."""
        entries = [
            (f.request.grammar, start, f.drafts) for f, start in zip(rows, row_start) if f.request.grammar is not None
        ]
        if not entries or self.grammars is None:
            return logits
        t0 = time.perf_counter()
        bitmask = self.grammars.fill_masks(entries, logits.shape[0])
        masked = [start + j for _, start, d in entries for j in range(len(d) + 1)]
        out = self.grammars.apply_masks(logits, bitmask, masked)
        self.grammars.seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def _penalized(
        logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] the frontier requests' rows
        rows: list[FrontierRow],
        row_start: list[int],  # per frontier request: its first row
    ) -> torch.Tensor:
        """The rows the tokens are chosen from: penalized where a request asks (workers/penalties.py).
        Logprobs stay those of the raw logits."""
        if not any(f.request.params.penalized for f in rows):
            return logits
        logits = logits.clone()
        for f, start in zip(rows, row_start):
            r = f.request
            if r.params.penalized:
                n = len(f.drafts) + 1
                logits[start : start + n] = penalize_rows(
                    logits[start : start + n], r.prompt_ids, r.output_ids, f.drafts, r.params
                )
        return logits

    def plain_picks(self, requests: list[Request]) -> Callable[[int, torch.Tensor, list[int]], list[int]]:
        """What plain steps of ``requests`` choose, for a run of steps with no commit between them (LLMEngine's
        decode_steps): ``pick(step, logits [R, V], argmax [R])`` gives each request's token ``step`` positions past
        its committed output, by the verify_coupled call :meth:`process` makes for a plain step of rows with no
        penalties, grammar or logprobs (the noise of each sampled request keyed by that position)."""
        params = [r.params for r in requests]
        no_drafts: list[list[int]] = [[] for _ in requests]

        def pick(step: int, logits: torch.Tensor, argmax: list[int]) -> list[int]:
            keys = [self._row_keys(r, 0, step) for r in requests]
            return [t[0] for t in verify_coupled(logits, no_drafts, params, keys, argmax).output_token_ids]

        return pick

    def plain_races(self, requests: list[Request], vocab: int) -> RowRaces:
        """:meth:`plain_picks`' choices in a form the native steps make themselves (``sampler.row_races``)."""
        positions = [len(r.output_ids) for r in requests]  # as _row_keys keys a run's first step
        return row_races([r.params for r in requests], [r.seed for r in requests], positions, vocab)

    def commit_steps(self, requests: list[Request], tokens: list[list[int]]) -> list[RequestOutput]:
        """Plain steps run with no commit between them (LLMEngine's decode_steps): ``tokens[i]``, request i's token
        of each step, committed as that many plain steps would commit them, up to its first stop. The KV of each step's
        fed token is computed: the pending one and every token but the last."""
        outputs = []
        for r, toks in zip(requests, tokens):
            r.num_computed += len(toks)
            for _ in toks:
                self._record(r, 0, 0)
            self.counters.plain_request_steps += len(toks)
            outputs.append(self.commit(r, toks))
            self.counters.output_tokens += len(outputs[-1].token_ids)
        return outputs

    def commit(self, r: Request, new_ids: Iterable[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Append the verified tokens up to the first stop, and say what the client gets."""
        committed: list[int] = []
        if r.params.max_tokens == 0:  # scoring only: the prompt is read, nothing is written
            self.finish(r, "length")
            return output(r, [], final=True)
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        for t in new_ids:
            r.output_ids.append(t)
            committed.append(t)
            if t in r.eos_token_ids:
                self.finish(r, "stop")
                break
            if r.detok.add(t):
                self.finish(r, "stop")
                break
            if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                self.finish(r, "length")
                break
        lps = None if logprobs is None else logprobs[: len(committed)]
        return output(r, committed, final=r.status is Status.FINISHED, logprobs=lps)


def output(r: Request, token_ids: list[int], final: bool, logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """One chunk of ``r``'s stream: the tokens and text committed since the last one."""
    return RequestOutput(
        request_id=r.request_id,
        token_ids=token_ids,
        text=r.detok.take(final),
        finished=final,
        finish_reason=r.finish_reason,
        num_prompt_tokens=len(r.prompt_ids),
        num_output_tokens=len(r.output_ids),
        num_cached_tokens=r.num_cached_tokens,
        proposer=r.proposer,
        spec=r.spec,
        first_token_time=r.first_token_time,
        arrival_time=r.arrival_time,
        events=r.events if final else None,
        seed=r.seed,
        logprobs=logprobs,
        prompt_logprobs=_take_prompt_logprobs(r),
    )


def _take_prompt_logprobs(r: Request) -> list[TokenLogprob | None] | None:
    """The prompt's logprobs, once, on the request's first output after its prefill."""
    if r.prompt_logprobs is None or r.prompt_logprobs_sent or r.in_prefill:
        return None
    r.prompt_logprobs_sent = True
    return r.prompt_logprobs
