"""The handshake: a client's ``hello`` (and ``length``) checked against the service's plan and bounds.

`Handshake.hello` turns a hello into a typed `Hello` or raises `RequestError`, in this order:
the protocol version (``protocol``), the fingerprints the client expects (``fingerprint``),
each integer field in its range (``protocol``), the topology — ranks that fit the world size, a
peer group of at most ``max_clients``, a step (data-parallel size × accumulation) of at most
``max_micro_batches_per_step`` and an epoch of the plan (``topology``) — then the client's
state (``fingerprint`` for another index or batching config, else ``state``), then the token,
resume digest and attempt (``protocol``). Nothing is planned before every check passed.
docs/service.md, "Bounds" and "Protocol".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import StateMismatchError
from ..feed import FeedError, FeedPosition
from ..plan import Plan
from ._config import ServiceConfig
from ._protocol import PROTOCOL, RequestError

MAX_GRAD_ACCUM = 4096
MAX_WORLD = 1 << 20


@dataclass(frozen=True)
class Hello:
    """A checked hello: who the client is, the topology it runs in, where it continues, its attempt."""

    rank: int
    world_size: int
    dp_rank: int
    dp_world_size: int
    grad_accum: int
    position: FeedPosition  # the client's, checked and moved to this topology (the plan's start when it sent none)
    token: str  # the client's own id, the same across its reconnections
    resume: str | None  # digest of the checkpoint it loaded; "start" for a job starting from scratch
    attempt: str | None  # the attempt a service named in an earlier welcome

    @property
    def key(self) -> tuple[int, int, int]:
        """Its stream: (data-parallel size, data-parallel rank, accumulation)."""
        return self.dp_world_size, self.dp_rank, self.grad_accum

    @property
    def group(self) -> int:
        """Its peer group: the clients sharing its stream (world size / data-parallel size)."""
        return self.world_size // self.dp_world_size


class Handshake:
    """Checks hellos and length requests against ``plan`` and ``config``'s bounds."""

    def __init__(self, plan: Plan, config: ServiceConfig) -> None:
        self.plan, self.config = plan, config
        per_epoch, epoch_words = epoch_micro_batches(plan)
        cap = min(config.max_micro_batches_per_step, config.max_micro_batches_dealt)
        self.max_step = min(cap, per_epoch)  # micro-batches a hello's step may deal: its cost, time and memory
        name = "max_micro_batches_per_step" if cap == config.max_micro_batches_per_step else "max_micro_batches_dealt"
        self._max_step_why = (
            f"{name} is {cap} in the service config"
            if cap <= per_epoch
            else f"an epoch of {config.index} deals {epoch_words}"
        )

    def hello(self, message: Mapping[str, Any], default_token: str) -> Hello:
        """``message`` checked (the module's order), or `RequestError`; ``default_token`` for a client without one."""
        protocol = message.get("protocol")
        if protocol != PROTOCOL:
            raise RequestError(
                "protocol",
                f"protocol version {protocol!r} is not served here (this service speaks "
                f"{PROTOCOL}); use an omnifeed client of the same version as the service",
            )
        for what in ("index_fingerprint", "config_fingerprint"):
            expected, mine = message.get(what), getattr(self.plan, what)
            if expected is not None and expected != mine:
                raise RequestError(
                    "fingerprint",
                    f"the client expects {what} {expected} but this service feeds "
                    f"{mine} ({self.config.index}); point the client at the service for its dataset",
                )
        rank = _int(message, "rank", 0, MAX_WORLD - 1)
        world = _int(message, "world_size", 1, MAX_WORLD)
        dp_world = _int(message, "dp_world_size", 1, world)
        dp_rank = _int(message, "dp_rank", 0, dp_world - 1)
        accum = _int(message, "grad_accum", 1, MAX_GRAD_ACCUM)
        if world % dp_world or rank >= world:
            raise RequestError(
                "topology", f"world size {world} (rank {rank}) is not a multiple of the data-parallel size {dp_world}"
            )
        group = world // dp_world
        if group > self.config.max_clients:
            raise RequestError(
                "topology",
                f"world size {world} at data-parallel size {dp_world} makes groups of {group} "
                f"peers that share a stream, but this service serves {self.config.max_clients} "
                "connections at most (max_clients in the service config)",
            )
        self._check_step(dp_world, accum)
        position = self._position(message.get("state"), dp_world, accum, _allowed(message))
        token = message.get("token", default_token)
        if not isinstance(token, str) or not 0 < len(token) <= 64:
            raise RequestError("protocol", "hello field 'token' must be a string of 1 to 64 characters")
        for name in ("resume", "attempt"):
            value = message.get(name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 64):
                raise RequestError("protocol", f"hello field {name!r} must be a string of 1 to 64 characters")
        resume = message.get("resume")
        if resume is None and message.get("state") is None:
            resume = "start"  # a job starting from scratch: as if it loaded the plan's first position
        return Hello(rank, world, dp_rank, dp_world, accum, position, token, resume, message.get("attempt"))

    def length(self, message: Mapping[str, Any]) -> int:
        """Micro-batches a data-parallel rank at ``state`` receives until its epoch is delivered
        (``len(FeedClient)``)."""
        dp_world = _int(message, "dp_world_size", 1, MAX_WORLD)
        accum = _int(message, "grad_accum", 1, MAX_GRAD_ACCUM)
        self._check_step(dp_world, accum)
        return self._position(message.get("state"), dp_world, accum, _allowed(message)).micro_batches_left(self.plan)

    def _check_step(self, dp_world: int, accum: int) -> None:
        if dp_world * accum > self.max_step:
            raise RequestError(
                "topology",
                f"a step at data-parallel size {dp_world} with grad_accum {accum} deals "
                f"{dp_world * accum} micro-batches, but this service deals at most {self.max_step} "
                f"per step ({self._max_step_why}); lower the data-parallel size or the accumulation",
            )

    def _position(self, state: Any, dp_world: int, accum: int, change: bool = False) -> FeedPosition:
        """The hello's state (wire form) read, checked and moved to this topology: one plan cursor, once; with
        ``change`` (the client allows a mixture change), carried over to this service's mixture weights first."""
        try:
            if state is None:
                return FeedPosition.start(self.plan, world_size=dp_world, grad_accum=accum)
            position = FeedPosition.from_dict(state)
            if change and self.plan.mixture is not None:
                position = position.with_mixture_changed(self.plan)
            return position.moved_to(self.plan, world_size=dp_world, grad_accum=accum)
        except StateMismatchError as exc:
            raise RequestError("fingerprint", str(exc)) from None
        except (ValueError, TypeError, KeyError, FeedError) as exc:
            raise RequestError("state", f"the client's state is not usable here: {exc}") from None


def _int(message: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError("protocol", f"hello field {name!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def epoch_micro_batches(plan: Plan) -> tuple[int, str]:
    """The most micro-batches an epoch of ``plan`` deals, and in words."""
    n = plan.num_samples
    if plan.bucketing is None:
        batch = plan.config.batch_size
        count = -(-(n - plan.dropped_per_epoch) // batch)
        return count, f"{count} micro-batches ({n} samples in batches of {batch})"
    return n, f"at most {n} micro-batches (one per sample)"


def _allowed(message: Mapping[str, Any]) -> bool:
    """The hello's ``allow_mixture_change`` (absent: false); a RequestError when it is not a boolean."""
    value = message.get("allow_mixture_change", False)
    if not isinstance(value, bool):
        raise RequestError("protocol", "hello field 'allow_mixture_change' must be true or false")
    return value
