"""Moving stage inputs and gradients between ranks.

Two transports with one interface: ``DistTransport`` here (torch.distributed
point-to-point on the pipeline's process group; its per-step wire state is in
``pipetrain.runtime.peers``) and ``InMemoryTransport`` (``pipetrain.runtime.local_transport``,
the single-process debug mode, where every rank runs in one process). Stages on the same
rank never use a transport: the executor hands their tensors over in memory.

A message is named by ``MessageKey(dst_stage, is_grad, microbatch)`` and travels as a
header and its tensors, or packed in one buffer (``pipetrain.runtime.wire_format``). Across
processes messages are matched by order, not by name or tag, because NCCL can do nothing
else: both ranks of a pair follow the pair's wire order (``pipetrain.schedules.wire``;
docs/transport.md explains the rules), and each header is checked against the name
expected there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.errors import PipelineError, StageMismatchError
from pipetrain.runtime.local_transport import InMemoryTransport
from pipetrain.runtime.peers import Entry, Peer, PeerEntries, Pending, peer_entries
from pipetrain.runtime.waits import finish, host_ints
from pipetrain.runtime.wire_format import (
    HEADER_LEN,
    TAG,
    Acks,
    Boundary,
    MessageKey,
    Specs,
    describe_failure,
    header_values,
    is_packable,
    message_parts,
    pack,
    packed_header,
    packed_size,
    packed_tensors,
    parse_header,
    specs_of,
)
from pipetrain.schedules.wire import PeerOrders

__all__ = [
    "DistTransport",
    "InMemoryTransport",
    "MessageKey",
    "backend_for",
    "describe_failure",
]


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend that moves tensors of ``device``: nccl for CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


class DistTransport:
    """Point-to-point messages over a torch.distributed process group (gloo or nccl).

    ``stage_ranks[s]`` is the group rank of stage ``s``. Messages match by each pair's wire
    order, not by tag; one pump per peer posts receives ahead of use (a boundary's first
    message with the shapes of the last finished step) and issues sends in order, and every
    wait has the timeout. The rules, why they hold on NCCL and gloo, and the measurements
    behind them: docs/transport.md.
    """

    def __init__(
        self,
        group: Any,
        stage_ranks: tuple[int, ...],
        device: torch.device,
        timeout_s: float,
        lookahead: int = 2,
        one_stream: bool | None = None,
    ) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        nccl = dist.get_backend(group) == "nccl"
        # NCCL runs both directions of a pair on one stream; gloo runs them apart (docs/transport.md).
        self._one_stream = nccl if one_stream is None else one_stream
        # Waits poll ``is_completed`` (``waits.finish``) where it is truthful: NCCL.
        self._polls = nccl
        self._stage_ranks = stage_ranks
        self._device = device
        self._timeout_s = timeout_s
        self._lookahead = lookahead
        self._step = 0
        self._label = ""  # the step as the caller names it in errors ("" = ``step N``)
        self._peers: dict[int, Peer] = {}
        # id(program's wire orders) -> (those orders, kept alive so the id stays theirs; entries)
        self._wires: dict[int, tuple[PeerOrders, PeerEntries]] = {}
        # A send whose SEND ran, waiting for its turn on one stream: (tensors, packed, missed).
        self._ready: dict[MessageKey, tuple[tuple[torch.Tensor, ...], bool, Specs | None]] = {}
        self._pending: dict[MessageKey, Pending] = {}
        self._sends: dict[MessageKey, tuple[list[Any], tuple[torch.Tensor, ...]]] = {}
        self._sent_specs: dict[Boundary, Specs] = {}
        self._recv_specs: dict[Boundary, Specs] = {}
        # id(program's wire orders) -> the shapes of each boundary's first message (sent,
        # received) in that program's last step every rank finished: this step's guess.
        self._guesses: dict[int, tuple[dict[Boundary, Specs], dict[Boundary, Specs]]] = {}
        self._sent_guess: dict[Boundary, Specs] = {}
        self._recv_guess: dict[Boundary, Specs] = {}
        self._connected: set[int] = set()
        self._acks: Acks = {}

    # ----------------------------------------------------------------- step bounds
    def begin_step(
        self, step: int, wires: Sequence[PeerOrders], where: str = "", acks: Acks | None = None
    ) -> None:
        """Start a step; ``wires`` holds this rank's wire orders by peer (one program).

        ``step`` numbers the messages on the wire (every pass, the same on all ranks);
        ``where`` names the step in errors as the caller counts it (default ``step N``);
        ``acks``: when its gradient sends are complete (``RankExecutor.acks``; else at the end).
        """
        self._acks = acks or {}
        if len(wires) != 1:
            raise PipelineError(f"a DistTransport runs one rank's program, got {len(wires)}")
        self._step = step
        self._label = where
        # Shapes may change from one step to the next (sequence length): learn them anew.
        self._sent_specs.clear()
        self._recv_specs.clear()
        wire = wires[0]
        cached = self._wires.get(id(wire))
        if cached is None or cached[0] is not wire:
            # Built once per program (training, evaluation): the orders never change.
            cached = (wire, peer_entries(self._rank, wire))
            self._wires[id(wire)] = cached
        self._peers = {peer: Peer(peer, order, index) for peer, (order, index) in cached[1].items()}
        self._sent_guess, self._recv_guess = self._guesses.setdefault(id(wire), ({}, {}))
        if self._one_stream:
            self._connect(sorted(set(self._peers) - self._connected))
        self.progress()

    @property
    def _where(self) -> str:
        return self._label or f"step {self._step}"

    def _connect(self, peers: list[int]) -> None:
        """Meet each new peer once, in one global order of pairs, before any message.

        ProcessGroupNCCL creates a pair's communicator at the pair's first send or receive,
        and both ranks block there until the other arrives. Left to the first message, a
        receive posted early would block its rank before the sends that its peer waits
        for (a ring of three ranks deadlocks). Every rank meets its peers in ascending
        order, so the pairs are met in one global order (lowest pair first) and each waits
        only for pairs met before it.
        """
        for peer in peers:
            token = torch.zeros(1, device=self._device)
            work: Any
            if self._rank < peer:
                work = dist.isend(token, group=self._group, group_dst=peer, tag=TAG)
            else:
                work = dist.irecv(token, group=self._group, group_src=peer, tag=TAG)
            try:
                finish(work, self._timeout_s, self._polls)
            except RuntimeError as exc:
                raise PipelineError(
                    f"rank {self._rank}: {self._where}, connecting to rank {peer} before "
                    f"the first message: peer rank {peer} {describe_failure(exc, self._timeout_s)}"
                ) from exc
            self._connected.add(peer)

    def commit_step(self) -> None:
        """The step just ended on every rank (the caller knows: its closing collective
        returned): its boundaries' shapes become the next step's guess. Committed only then,
        so that both ends of a boundary always hold the same guess: a step that failed on
        some rank changes no guess on any."""
        self._sent_guess.update(self._sent_specs)
        self._recv_guess.update(self._recv_specs)

    def end_step(self) -> None:
        """Wait until every send of the step has left (its buffers may then be freed)."""
        for key in list(self._sends):
            self._release(key)
        left = [
            f"{entry.key} with rank {peer.rank}"
            for peer in self._peers.values()
            for entry in peer.order[peer.head :]
            if self._one_stream or not entry.outgoing  # else ``send`` issued it
        ]
        left += [str(key) for key in self._pending]
        if left:
            raise PipelineError(
                f"rank {self._rank}: {self._where} ended with messages never sent or "
                f"received: {', '.join(left)}"
            )

    # ----------------------------------------------------------------- the pumps
    def progress(self) -> None:
        """Move every peer's pump as far as it goes without blocking (docs/transport.md)."""
        for peer in self._peers.values():
            self._pump(peer, None)

    def _pump(self, peer: Peer, through: int | None) -> None:
        """Post or issue ``peer``'s messages in order: through entry ``through``, reading
        headers where needed, or, with None, as far as possible without blocking."""
        while peer.head < len(peer.order) and (through is None or peer.head <= through):
            entry = peer.order[peer.head]
            if entry.outgoing and not self._one_stream:
                pass  # its own direction: ``send`` issues it (docs/transport.md)
            elif entry.outgoing:
                ready = self._ready.pop(entry.key, None)
                if ready is None:
                    if through is None:
                        return
                    raise PipelineError(
                        f"rank {self._rank}: {self._where}, the wire order to rank {peer.rank} "
                        f"sends {entry.key} before its SEND ran: the order breaks its own rules"
                    )
                self._issue(entry, peer.rank, *ready)
            else:
                boundary = (entry.src_stage, entry.key.dst_stage, entry.key.is_grad)
                specs = self._recv_specs.get(boundary)
                if specs is not None:
                    # A later message of its boundary, of known shapes: packed when small,
                    # else its header and its payload (posted at once, checked on arrival).
                    if through is None and peer.ahead >= self._lookahead:
                        return
                    if is_packable(specs):
                        self._post_packed(entry, peer.rank, specs)
                    else:
                        pending = self._post_header(entry, peer.rank)
                        pending.predicted = specs
                        self._post_payload(pending, entry.key, peer.rank, specs)
                else:
                    # A boundary's first message: posted as guessed, or header first; the
                    # pump stays here until its header is read (docs/transport.md).
                    pending = self._pending.get(entry.key) or self._post_first(entry, peer.rank)
                    if through is None:
                        return
                    self._read_first(entry.key, pending, peer.rank)
                peer.ahead += 1
            peer.head += 1

    def _issue(
        self,
        entry: Entry,
        peer: int,
        tensors: tuple[torch.Tensor, ...],
        packed: bool,
        missed: Specs | None = None,
    ) -> None:
        """Send one message; ``missed``: the receiver posted these guessed shapes, not the
        message's, so a filler of their sizes goes between the header and the payload."""
        key = entry.key
        values = header_values(self._step, entry.src_stage, key, tensors)
        if packed:
            buf = pack(values, tensors)
            self._sends[key] = ([self._post(buf, peer, key, sending=True)], (buf,))
            return
        parts = message_parts(values, tensors, missed, self._device)
        works = [self._post(t, peer, key, sending=True) for t in parts]
        self._sends[key] = (works, parts)

    def _post_first(self, entry: Entry, peer: int) -> Pending:
        """Post a boundary's first message of the step: with the guessed shapes (packed or
        header and payload, as a later message of those shapes), else its header alone."""
        guess = self._recv_guess.get((entry.src_stage, entry.key.dst_stage, entry.key.is_grad))
        if guess is None:
            return self._post_header(entry, peer)
        if is_packable(guess):
            return self._post_packed(entry, peer, guess)
        pending = self._post_header(entry, peer)
        pending.predicted = guess
        self._post_payload(pending, entry.key, peer, guess)
        return pending

    def _read_first(self, key: MessageKey, pending: Pending, peer: int) -> None:
        """Read a boundary's first header of the step; its shapes become the step's. Where
        they are not the posted guess, the guessed buffers hold the sender's filler: wait
        for it, then post the payload the header announces (docs/transport.md)."""
        specs = self._read_header(key, pending)
        if pending.predicted is None:  # header first: the payload is posted now
            self._post_payload(pending, key, peer, specs)
            return
        if specs == pending.predicted:
            return
        for work in pending.payload_works:
            self._wait(work, key)
        pending.packed = pending.predicted = None
        self._post_payload(pending, key, peer, specs)

    def _post_header(self, entry: Entry, peer: int) -> Pending:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)
        work = self._post(header, peer, entry.key, sending=False)
        pending = Pending(entry.src_stage, header, work)
        self._pending[entry.key] = pending
        return pending

    def _read_header(self, key: MessageKey, pending: Pending) -> Specs:
        """Wait for a header (a packed message: all of it) and check it, once; the first of
        a boundary sets its shapes."""
        if pending.specs is None:
            if pending.packed is not None:
                for work in pending.payload_works:
                    self._wait(work, key)
                pending.payload_works = []  # complete
                values = packed_header(pending.packed)
            else:
                assert pending.header is not None
                self._wait(pending.header_work, key)
                values = host_ints(pending.header)
            pending.specs = parse_header(values, self._step, pending.src, key, self._label)
            self._recv_specs.setdefault((pending.src, key.dst_stage, key.is_grad), pending.specs)
        return pending.specs

    def _post_packed(self, entry: Entry, peer: int, specs: Specs) -> Pending:
        buf = torch.empty(packed_size(specs), dtype=torch.uint8, device=self._device)
        pending = Pending(entry.src_stage, None, None)
        pending.packed = buf
        pending.predicted = specs
        pending.payload_works = [self._post(buf, peer, entry.key, sending=False)]
        self._pending[entry.key] = pending
        return pending

    def _post_payload(self, pending: Pending, key: MessageKey, peer: int, specs: Specs) -> None:
        payload = tuple(
            torch.empty(shape, dtype=dtype, device=self._device) for dtype, shape in specs
        )
        pending.payload = payload
        pending.payload_works = [self._post(t, peer, key, sending=False) for t in payload]

    def _post(self, tensor: torch.Tensor, peer: int, key: MessageKey, sending: bool) -> Any:
        """Post one transfer; gloo refuses at once on a connection its peer has closed."""
        try:
            if sending:
                return dist.isend(tensor, group=self._group, group_dst=peer, tag=TAG)
            return dist.irecv(tensor, group=self._group, group_src=peer, tag=TAG)
        except RuntimeError as exc:
            raise self.failure(exc, key, sending, peer=peer) from exc

    # ----------------------------------------------------------------- send, receive
    def send(self, key: MessageKey, src_stage: int, tensors: tuple[torch.Tensor, ...]) -> None:
        specs = specs_of(tensors)
        boundary = (src_stage, key.dst_stage, key.is_grad)
        first = self._sent_specs.get(boundary)
        missed = None
        if first is None:
            # The boundary's first message of the step. The receiver posted the guess, if
            # there is one: send as a later message of its shapes would go, or with a
            # filler where the shapes changed (docs/transport.md); else header first.
            self._sent_specs[boundary] = specs
            guess = self._sent_guess.get(boundary)
            packed = guess == specs and is_packable(specs)
            missed = guess if guess is not None and guess != specs else None
        elif specs != first:
            raise StageMismatchError(
                f"stage {src_stage} sends {specs} to stage {key.dst_stage} for micro-batch {key.microbatch} "
                f"but {first} for an earlier micro-batch of {self._where}: every micro-batch of a step "
                f"must give the same shapes at a stage boundary"
            )
        else:
            packed = is_packable(specs)  # a later message: packed when small
        peer = self._peer_of(key, self._stage_ranks[key.dst_stage])
        payload = tuple(t.detach().contiguous() for t in tensors)
        if not self._one_stream:
            # Sends run in program order, which is their wire order (rule 1).
            self._issue(Entry(key, src_stage, True), peer.rank, payload, packed, missed)
            return
        self._ready[key] = (payload, packed, missed)
        self._pump(peer, peer.index[key])
        # What follows it may be receives the next action needs: post them now, not there.
        self._pump(peer, None)

    def _release(self, key: MessageKey) -> None:
        entry = self._sends.pop(key, None)
        if entry is not None:
            for work in entry[0]:
                self._wait(work, key, sending=True)

    def recv(self, key: MessageKey, src_stage: int) -> tuple[torch.Tensor, ...]:
        peer = self._peer_of(key, self._stage_ranks[src_stage])
        self._pump(peer, peer.index[key])
        pending = self._pending[key]
        if pending.packed is not None:
            payload = self._unpack(key, pending)
        else:
            specs = self._read_header(key, pending)
            if pending.predicted is not None and specs != pending.predicted:
                raise self._mismatch(key, pending, specs)
            for work in pending.payload_works:
                self._wait(work, key)
            assert pending.payload is not None
            payload = pending.payload
        del self._pending[key]
        peer.ahead -= 1
        # Sends this message proves complete, freed now rather than at the end of the step:
        # the activations of k that a gradient of k was computed from, and our gradients
        # that its sender had received before it sent it.
        if key.is_grad:
            self._release(MessageKey(src_stage, False, key.microbatch))
        for sent in self._acks.get(key, ()):
            self._release(sent)
        return payload

    def _unpack(self, key: MessageKey, pending: Pending) -> tuple[torch.Tensor, ...]:
        """A packed message's tensors, once its header says it is the one expected."""
        assert pending.packed is not None and pending.predicted is not None
        specs = self._read_header(key, pending)
        if specs != pending.predicted:
            raise self._mismatch(key, pending, specs)
        return packed_tensors(pending.packed, pending.predicted)

    def _mismatch(self, key: MessageKey, pending: Pending, specs: Specs) -> StageMismatchError:
        return StageMismatchError(
            f"stage {pending.src} announced {specs} for micro-batch {key.microbatch} but stage "
            f"{key.dst_stage} expected {pending.predicted} like the earlier micro-batches of {self._where}"
        )

    def _peer_of(self, key: MessageKey, rank: int) -> Peer:
        peer = self._peers.get(rank)
        if peer is None or key not in peer.index:
            raise PipelineError(
                f"rank {self._rank}: {self._where}, {key} with rank {rank} is not in this "
                f"program's wire order: build the transport's step from the same schedule"
            )
        return peer

    # ----------------------------------------------------------------- failures
    def _wait(self, work: Any, key: MessageKey, sending: bool = False) -> None:
        try:
            finish(work, self._timeout_s, self._polls)
        except RuntimeError as exc:
            raise self.failure(exc, key, sending) from exc

    def failure(
        self, exc: BaseException, key: MessageKey, sending: bool, peer: int | None = None
    ) -> PipelineError:
        if peer is None:
            src = self._pending[key].src if key in self._pending else None
            peer_stage = key.dst_stage if sending else src
            if peer_stage is not None:
                peer = self._stage_ranks[peer_stage]
        what = "gradient" if key.is_grad else "activations"
        verb = f"sending {what} to" if sending else f"receiving {what} for"
        return PipelineError(
            f"rank {self._rank}: {self._where}, {verb} stage {key.dst_stage} (micro-batch "
            f"{key.microbatch}): "
            f"peer rank {'?' if peer is None else peer} {describe_failure(exc, self._timeout_s)}"
        )
