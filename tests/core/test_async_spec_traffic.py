"""Async scheduling with draft slots, end to end on the CPU side: the real Scheduler against a
simulated Worker built from the real `InputBatch` and `DraftSlots`, two steps in flight, the
Worker running each step only after the next one was scheduled (the latest it may). Drafts are
random guesses at a fixed "true" continuation, so acceptance varies; requests are aborted and
preempted at random. Checked: every output equals the true continuation and stops at
max_tokens; the Worker's block table equals the scheduler's; every key a step reads (its
sliding window's, where one is set) lies in a block the request held when the step was
scheduled and holds that key's token; the accounting returns to rest."""

from __future__ import annotations

import random
import zlib
from collections import deque

import msgspec
import pytest

from vx.config import BLOCK_SIZE, SpeculativeConfig
from vx.core.request import RequestStatus
from vx.core.scheduler import Scheduler
from vx.gpu.input_batch import InputBatch
from vx.gpu.spec_decode.slots import DraftSlots
from vx.messages import ModelRunnerOutput, SchedulerOutput

from .helpers import EOS, make_add_request, make_config

K = 3


def _truth(req_id: str, index: int) -> int:
    t = zlib.crc32(f"{req_id}:{index}".encode()) % 37
    return EOS if t == 0 else 1000 + t


class _Worker:
    def __init__(self, rng: random.Random, max_model_len: int, window: int | None) -> None:
        self.rng = rng
        self.window = window
        self.batch = InputBatch(
            32, max_model_len, -(-max_model_len // BLOCK_SIZE), speculative=True
        )
        self.slots = DraftSlots()
        self.tokens: dict[str, list[int]] = {}
        #: the token whose KV each (block, offset) holds: what attention would read
        self.kv: dict[tuple[int, int], int] = {}

    def execute(self, so: SchedulerOutput, held_at: dict[str, list[int]]) -> ModelRunnerOutput:
        batch = self.batch
        batch.apply(so)
        for r in (*so.finished_req_ids, *so.preempted_req_ids):
            self.slots.drop(r)
            self.tokens.pop(r, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        scored = None
        if so.scheduled_spec_decode_tokens:
            so, scored = self.slots.fill(so)
        req_ids, sampled, drafts = [], [], {}
        for r, n in so.num_scheduled_tokens.items():  # the step's KV writes
            row = batch.req_id_to_index[r]
            own = int(batch.num_computed_tokens[row])
            step = self.tokens[r] + list(so.scheduled_spec_decode_tokens.get(r, []))
            for pos in range(own, own + n):
                b = int(batch.block_table[row, pos // BLOCK_SIZE])
                self.kv[b, pos % BLOCK_SIZE] = step[pos]
        for r, n in so.num_scheduled_tokens.items():
            row = batch.req_id_to_index[r]
            own = int(batch.num_computed_tokens[row])
            toks = self.tokens[r]
            d = so.scheduled_spec_decode_tokens.get(r, [])
            assert own + n - len(d) <= len(toks), (r, own, n, len(toks))
            # every written position lies in a block the scheduler still gives the request
            held = held_at[r]  # the request's blocks when this step was scheduled
            table = batch.block_table[row, : batch.num_blocks[row]].tolist()
            for pos in range(own, own + n):
                assert pos // BLOCK_SIZE < len(table), (r, pos, table)
                assert pos // BLOCK_SIZE < len(held), (r, pos, held)
                assert held[pos // BLOCK_SIZE] == table[pos // BLOCK_SIZE]
            # attention reads the keys of its window (every request's KV is written first):
            # each must hold its token, in a block the request still holds
            step = toks + list(d)
            first = 0 if self.window is None else max(0, own - self.window + 1)
            for pos in range(first, own + n):
                b = table[pos // BLOCK_SIZE]
                assert held[pos // BLOCK_SIZE] == b, ("freed", r, pos, held, table)
                got = self.kv.get((b, pos % BLOCK_SIZE))
                assert got == step[pos], (r, pos, got, step[pos])
            req_ids.append(r)
            if own + n - len(d) < len(toks):  # a prefill chunk
                sampled.append([])
                batch.num_computed_tokens[row] = own + n
                continue
            base = len(toks)
            out = []
            for j, t in enumerate(d):
                if t != _truth(r, base + j):
                    break
                out.append(t)
            out.append(_truth(r, base + len(out)))
            toks += out
            sampled.append(out)
            batch.num_computed_tokens[row] = own + n - (len(d) + 1 - len(out))
            # the next drafts: a guess at the continuation, right for a random prefix
            nd = self.rng.randint(0, K)
            good = self.rng.randint(0, nd)
            guess = [_truth(r, len(toks) + j) for j in range(nd)]
            for j in range(good, nd):
                guess[j] = 7
            if guess:
                drafts[r] = guess
        self.slots.keep(req_ids, sampled, drafts)
        return ModelRunnerOutput(
            step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled,
            spec_token_ids=drafts, spec_num_scored=scored,
        )  # fmt: skip


@pytest.mark.parametrize("seed", range(9))
def test_async_draft_slots_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    config = msgspec.structs.replace(
        make_config(async_scheduling=True, max_num_batched_tokens=48, max_model_len=256),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K),
    )
    window = (None, 20, 33)[seed % 3]
    s = Scheduler(config, 12, sliding_window=window)
    w = _Worker(rng, 256, window)
    emitted: dict[str, list[int]] = {}
    limits: dict[str, int] = {}
    prompts: dict[str, int] = {}
    free_run = {f"r{i}" for i in range(20) if rng.random() < 0.5}
    done: set[str] = set()
    in_flight: deque[tuple[SchedulerOutput, dict[str, list[int]]]] = deque()
    n = 0
    for _ in range(3000):
        if n < 20 and rng.random() < 0.5:
            r = f"r{n}"
            n += 1
            limits[r] = rng.randint(1, 30)
            prompt = [1] * rng.choice((0, 16, 32)) + [
                rng.randint(1, 40) for _ in range(rng.randint(1, 40))
            ]
            s.add_request(
                make_add_request(r, prompt, max_tokens=limits[r], ignore_eos=r in free_run)
            )
            emitted[r] = []
            prompts[r] = len(prompt)
        if rng.random() < 0.03 and s.requests:
            r = rng.choice(sorted(s.requests))
            s.finish_requests(r, RequestStatus.FINISHED_ABORTED)
            done.add(r)
        if len(in_flight) < 2 and s.has_unfinished_requests():
            so = s.schedule()
            if so.total_num_scheduled_tokens:
                held = {r: s.kv_cache_manager.get_block_ids(r) for r in so.num_scheduled_tokens}
                in_flight.append((so, held))
                if len(in_flight) < 2:
                    continue
        if not in_flight:
            if not s.has_unfinished_requests() and n >= 20:
                break
            continue
        so, held = in_flight.popleft()
        for out in s.update_from_output(so, w.execute(so, held)):
            if out.request_id in done:
                continue
            emitted[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                done.add(out.request_id)
        report = s.kv_self_check()
        assert report["ok"], report["problems"]
        for r in s.running:
            assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
    assert not in_flight and not s.has_unfinished_requests()
    assert s.kv_self_check()["idle"]
    for r, toks in emitted.items():
        assert toks == [_truth(r, prompts[r] + j) for j in range(len(toks))], r
        assert len(toks) <= limits[r], r
        if r not in free_run and EOS in toks:
            assert toks.index(EOS) == len(toks) - 1, (r, toks)
    assert s.num_draft_tokens_total > 0 and s.num_accepted_tokens_total > 0
