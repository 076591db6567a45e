"""Episodes: a multi-turn agentic rollout as one training sample in the store.

An episode's tokens are every turn's, concatenated: prompt, completion, tool output, the
next turn's completion, ... Each `add_turn` gets the whole sequence as the engine saw it at
the end of that turn and the routes the engine returned for it (-1 where it returned none:
prefix-cached rows it was not asked for, the last sampled token). The turn is put as the
episode so far: the history's rows are the stored earlier turn's wherever it has them
(the routes those tokens were generated and cached with; an engine that recomputed the
history differently is counted in `conflicts`, not stored), and the history's tokens must
match (a history that changed raises `TokenMismatchError` naming the episode, turn and
position); this turn's rows fill the rest; rows nobody recorded stay missing, never
guessed.
Because the earlier rows are copied, the new sample's full pages equal the earlier turn's
and the store shares them. `close()` releases the earlier turns and returns the one ref the
trainer gets.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import FrameType
from typing import Any, NamedTuple

import numpy as np

from routing_replay.errors import (
    DuplicateSampleError,
    InvalidArgumentError,
    InvalidRoutesError,
    RoutingReplayError,
    SampleNotFoundError,
    SampleReplacedError,
    TokenMismatchError,
)
from routing_replay.layout import MISSING
from routing_replay.store.calls import fork_bound, inside_call
from routing_replay.store.format import MAX_SAMPLE_ID_BYTES
from routing_replay.store.refs import PutRequest, RoutingRef, sample_id_bytes, whole_number
from routing_replay.store.routing_store import RoutingStore
from routing_replay.store.segment import fork_epoch
from routing_replay.validate import host_array

TURN_DIGITS = 6  # turns an episode id leaves room for: up to 999,999


class _Pending(NamedTuple):
    """A turn's put not yet in `Episode.refs`, settled by the episode's next call."""

    sample_id: str
    mark: int  # the random mark its slot carries, if it committed
    made_in: int  # the fork epoch of the process that made it
    ended_in: int | None = None  # the fork epoch its add_turn call ended in (None: running)


class Episode:
    """One multi-turn episode in `store`: `add_turn` per turn, `close` for the trainer's ref.

    Turn samples are named `<episode_id>-t<turn>` (turns count from 1). `prompt_len` of
    every turn's sample is the first turn's prompt length.
    """

    def __init__(self, store: RoutingStore, episode_id: str, *, prompt_len: int | None = None):
        longest = f"{episode_id}-t{10**TURN_DIGITS - 1}"  # room for the turns' sample ids
        if not isinstance(episode_id, str) or len(longest.encode()) > MAX_SAMPLE_ID_BYTES:
            raise InvalidArgumentError(
                f"episode id {episode_id!r} must be a str of at most "
                f"{MAX_SAMPLE_ID_BYTES - TURN_DIGITS - 2} bytes: its turns are stored as "
                f"'<id>-t<turn>', sample ids of at most {MAX_SAMPLE_ID_BYTES} bytes"
            )
        sample_id_bytes(longest)  # the characters of a sample id
        self.store = store
        self.episode_id = episode_id
        self.prompt_len = prompt_len
        self.refs: list[RoutingRef] = []  # one per turn, the last one is the episode so far
        self._tokens = np.zeros(0, dtype=np.int64)
        self._routes: np.ndarray | None = None  # the last turn's stored routes
        self._versions: list[tuple[int, int]] = []
        self._closed = False
        self._putting: _Pending | None = None  # a turn's put until it is in `refs`
        self.conflicts = 0  # history rows an engine returned again, differently (kept: stored)
        # The add_turn and close calls running: their threads and frames (`_alone`).
        self._calls: dict[object, tuple[threading.Thread, FrameType]] = {}

    @property
    def num_turns(self) -> int:
        """Turns added so far."""
        return len(self.refs)

    @property
    def tokens(self) -> np.ndarray:
        """The episode's tokens so far (its last turn's)."""
        return self._tokens

    @property
    def ref(self) -> RoutingRef | None:
        """The ref of the episode so far (its last turn's sample)."""
        return self.refs[-1] if self.refs else None

    def add_turn(
        self, token_ids: Any, routes: Any, *, policy_version: int | None = None
    ) -> RoutingRef:
        """Put the episode up to the end of this turn; returns that sample's ref.

        `token_ids` `[T]`: every token so far (earlier turns, tool output, this turn's
        prompt and completion). `routes` `[T, L, K]` (MoE layers or all layers, -1 where
        the engine returned none). `policy_version`: the version this turn was generated
        with (the ref then carries one span per version).
        """
        call = self._alone()
        try:
            return self._add_turn(token_ids, routes, policy_version)
        finally:
            self._calls.pop(call, None)
            # Stopped or raising: its put's call ended here (not a parent's running put).
            pending = self._putting
            if pending and pending.made_in == fork_epoch() and pending.ended_in is None:
                self._putting = pending._replace(ended_in=fork_epoch())

    def _add_turn(self, token_ids: Any, routes: Any, policy_version: int | None) -> RoutingRef:
        if self._closed:
            raise RoutingReplayError(f"episode {self.episode_id!r} is closed")
        turn = self.num_turns + 1
        tokens = _turn_tokens(token_ids, self.episode_id)
        layout = self.store.layout
        given = layout.select_moe(routes)
        if given.dtype == layout.dtype:  # the stored narrow form: its marker is missing
            given = layout.decode(given)
        rows = np.array(given, dtype=np.int64)  # a copy, -1 missing
        if rows.shape[0] != len(tokens):
            raise InvalidRoutesError(
                f"episode {self.episode_id!r} turn {turn}: {len(rows)} rows of routes for "
                f"{len(tokens)} tokens; pass one row per token (-1 where none was returned)"
            )
        before = len(self._tokens)
        if len(tokens) <= before:
            raise InvalidRoutesError(
                f"episode {self.episode_id!r} turn {turn} has {len(tokens)} tokens, no more "
                f"than the {before} of the turns before it: a turn appends tokens"
            )
        self.check_history(tokens, turn)
        if self._routes is not None:  # the stored rows of the history win
            earlier = self._routes
            recorded = ~(earlier == MISSING).all(-1).all(-1)  # [before]: rows stored
            returned = ~(rows[:before] == MISSING).all(-1).all(-1)
            differ = recorded & returned & (rows[:before] != earlier).any(-1).any(-1)
            self.conflicts += int(differ.sum())
            rows[:before][recorded] = earlier[recorded]
        if policy_version is not None and not whole_number(policy_version):
            raise InvalidArgumentError(
                f"episode {self.episode_id!r} turn {turn}: policy_version must be an int >= 0 "
                f"(the version this turn was generated with), got {policy_version!r}"
            )
        versions = list(self._versions)
        if policy_version is not None and (not versions or versions[-1][1] != policy_version):
            versions.append((before, int(policy_version)))
        elif policy_version is None and versions:
            raise InvalidRoutesError(
                f"episode {self.episode_id!r} turn {turn}: earlier turns had policy versions, "
                "this one has none; pass policy_version for every turn or for none"
            )
        self._drop_unrecorded()
        sample_id = f"{self.episode_id}-t{turn}"
        if sample_id in self.store:  # another's (a restarted loop's): never ours to release
            raise DuplicateSampleError(
                f"episode {self.episode_id!r} turn {turn}: sample {sample_id!r} is already in "
                f"store {self.store.name!r} (another episode with this id, or this turn "
                "still being put when this process was forked: the parent's?): give every "
                "episode a unique id; nothing of this turn was stored"
            )
        mark = int.from_bytes(os.urandom(8), "little") | 1  # this put's, never NO_MARK
        request = PutRequest(sample_id, rows, self.prompt_len, tokens, versions or None)
        # Stopped (Ctrl-C) or raising, with or without its commit: the next call settles it.
        self._putting = _Pending(sample_id, mark, fork_epoch())
        ref = self.store._put_marked(request, mark)
        turns = [*self.refs, ref]
        # One line, no call in it: a stop lands before or after, never between the turn's
        # ref and the state the next turn builds on.
        self.refs, self._tokens, self._routes, self._versions = turns, tokens, rows, versions
        self._putting = None
        return ref

    def _alone(self) -> object:
        """Refuse a call while another add_turn or close of this episode runs (its turns come
        one after another; a close must not overtake a turn): one of another thread, or one
        of this thread that a signal handler interrupted. Returns the caller's entry in
        `_calls`, which it removes when it returns.

        Each call enters its frame, then looks at the frames entered before its own (the
        dict keeps their order): of calls at once the first goes on, the others are refused.
        A frame entered by a call that a stop cut short is dropped once that call is done:
        `frame.clear()` refuses a running frame only. (Not `sys._current_frames()`: a
        collection inside it can hang CPython before 3.11.9, gh-106883.)"""
        caller, call = sys._getframe(1), object()  # (add_turn's or close's frame)
        self._calls[call] = (threading.current_thread(), caller)  # (enumerated from now)
        # This thread's call below the caller (it may not have entered yet), then the others.
        alone = not inside_call(self, caller.f_back, _CALLS)
        # Threads as objects: after a fork only this one is left, and a new thread of the
        # child may get the ident of one that is gone. The entries copied in C: another
        # thread may enter meanwhile.
        threads, entries = set(threading.enumerate()), tuple(self._calls.copy().items())
        for other, (thread, frame) in entries if alone else ():
            if other is call:
                break  # (the calls entered after this one wait for it)
            try:
                if thread in threads:  # (a frame of a thread that is gone never ends)
                    frame.clear()  # a call that is done: its entry was left by a stop
            except RuntimeError:  # running
                alone = False
                break
            self._calls.pop(other, None)
        if not alone:
            self._calls.pop(call, None)
            raise RoutingReplayError(
                f"episode {self.episode_id!r}: another call is inside add_turn or close "
                "of this episode (another thread's, or this thread's, interrupted by a "
                "signal handler); its calls come one after another: call again once it "
                "returned"
            )
        return call

    def _drop_unrecorded(self) -> None:
        """Release the sample of a turn whose put committed but never reached `refs` (an
        interruption in between), so that the turn can be added again and `close` leaves
        nothing: the sample under its id if its slot carries that put's mark (a put of that
        id by another, before, meanwhile or after, carries another). A fork child settles
        only a put whose add_turn call had ended before the fork: one running then (in
        another thread, or this one, forked from inside it) is the parent's to settle.
        Cleared once settled."""
        if self._putting is None:
            return
        sample_id, mark, made_in, ended_in = self._putting
        recorded = bool(self.refs) and self.refs[-1].sample_id == sample_id
        over = made_in == fork_epoch() or (ended_in is not None and ended_in < fork_epoch())
        stored = self.store._put_of(sample_id) if over and not recorded else None
        if stored is not None and stored[1] == mark:
            put = RoutingRef(
                sample_id, self.store.name, self.store.node_id, 0, None, self.store.store_uid,
                serial=stored[0],
            )  # fmt: skip
            with contextlib.suppress(SampleReplacedError, SampleNotFoundError):
                self.store.release([put])  # (that very put only)
        self._putting = None

    def check_history(self, token_ids: Any, turn: int | None = None) -> None:
        """Raise `TokenMismatchError` unless `token_ids` start with the episode's tokens
        (call it before generating a turn: a re-tokenised history fails before any work)."""
        turn = self.num_turns + 1 if turn is None else turn
        tokens = _turn_tokens(token_ids, self.episode_id)
        before = self._tokens
        if len(tokens) < len(before):
            raise TokenMismatchError(
                f"episode {self.episode_id!r} turn {turn}: {len(tokens)} tokens, fewer than "
                f"the {len(before)} of its history: a turn must extend the conversation"
            )
        differ = np.flatnonzero(tokens[: len(before)] != before)
        if len(differ):
            pos = int(differ[0])
            raise TokenMismatchError(
                f"episode {self.episode_id!r} turn {turn}: token {pos} of the history is "
                f"{int(tokens[pos])} but turn {turn - 1} stored {int(before[pos])} there "
                f"({len(differ)} of {len(before)} history tokens differ): the chat template "
                "re-tokenised the history, so earlier routes no longer align. Build each "
                "turn's prompt by appending token ids to the previous turn's, not by "
                "re-rendering the conversation"
            )

    def close(self) -> RoutingRef:
        """Release the earlier turns' samples; the last turn's ref is the episode's. A close
        stopped half-way is finished by the next."""
        call = self._alone()
        try:
            return self._close()
        finally:
            self._calls.pop(call, None)

    def _close(self) -> RoutingRef:
        self._drop_unrecorded()
        if not self.refs:
            raise RoutingReplayError(f"episode {self.episode_id!r} has no turns")
        if not self._closed:
            earlier = [r for r in self.refs[:-1] if r in self.store]  # (not yet released)
            if earlier:
                self.store.release(earlier)
            self._closed = True
        return self.refs[-1]


_CALLS = {Episode.add_turn.__code__, Episode.close.__code__}  # (`Episode._alone`)
fork_bound(Episode.add_turn, Episode.close)  # a turn running at a fork is the parent's


def _turn_tokens(token_ids: Any, episode_id: str) -> np.ndarray:
    """A turn's token ids as int64 `[T]`, or InvalidArgumentError (floats, strings: refused
    as `put` refuses them, not cast)."""
    tokens = host_array(token_ids, f"episode {episode_id!r}: token_ids")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"episode {episode_id!r}: token_ids must be a 1-D integer array (every token so "
            f"far), got shape {tokens.shape} and dtype {tokens.dtype}"
        )
    return tokens.astype(np.int64)
