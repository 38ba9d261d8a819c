"""The append path: validation, the write-and-dispatch critical section, offset assignment.

Three entry points of MessageStore end here: append_encoded (a batch, :meth:`Appender.append`)
and put / put_async (one message, :meth:`Appender.put`: the same checks without the batch
loop). A message resolves its (topic, light queues) pair through a cached :class:`Route`
(names validated once, the INNER_* property head, the queue states) and is checked against
worst-case sizes before the lock, so an error means nothing of the batch was written.

Under the store lock (:meth:`Appender._section`) the parent queue offset, every light-queue
offset and the physical offset are assigned together, and each record's unit joins its queues
before the lock is released, so a get right after a put sees the message. The layers do the
rest: the CommitLog's BatchWriter places the records (one write per batch, rolls), the record
step (format.append_record) builds each record, and consumequeue.dispatch adds its units.

A batch whose messages all have a cached, resolved route and fit it (a fleet's steady state)
takes one step instead, under the lock: ``_append_batch`` checks every message, then writes
and dispatches them and collects the queue ends for the listeners, with no prepared tuple per
message (:meth:`Appender._append_common`); any other batch, or one message, goes through the
two loops.

Accelerated: store/_speedups.c has the record step (append_record), the two loops' common
cases (prepare_run, write_run) and the one step (append_batch), each the twin of the Python
reference beside it here or in format.py; LMQTT_PURE_PYTHON (every accelerator) or
LMQTT_PURE_PYTHON_APPEND (this path's, for A/B runs; the record step follows
LMQTT_PURE_PYTHON only) keep the references.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from store.commitlog import BatchWriter, CommitLog
from store.consumequeue import ConsumeQueue, ConsumeQueueTable, dispatch
from store.errors import (
    InvalidPropertyError,
    InvalidQueueNameError,
    MessageTooLargeError,
    StoreClosedError,
)
from store.format import (
    CQ_UNIT,
    CRC_TRAILER_SIZE,
    FIXED_OVERHEAD,
    MAX_PROPERTIES_BYTES,
    MAX_TOPIC_BYTES,
    RESERVED_PROPERTIES,
    append_record,
    encode_queue_dir,
    inner_head,
)
from store.kernel import load as load_kernel
from store.results import ArrivalListener, PutResult

log = logging.getLogger("lmqtt.store")

_FORBIDDEN_NAME_CHARS = frozenset(",\x00\x01\x02")
_ROUTE_CACHE_LIMIT = 200_000
_RECORD_OVERHEAD = FIXED_OVERHEAD + CRC_TRAILER_SIZE
_MAX_USER_PROPS = MAX_PROPERTIES_BYTES - CRC_TRAILER_SIZE
_MAX_OFFSET = (1 << 63) - 1
_pack_unit = CQ_UNIT.pack
_time = time.time
#: Builds PutResult without the Python-level NamedTuple __new__ (one call less per message);
#: same type, same fields.
_tuple_new = tuple.__new__


class Route:
    """What every put to one (topic, light queues) pair shares, worked out once.

    Names are validated when the route is made. ``inner_head`` is the INNER_* property pair
    up to the light-queue offsets (only they vary per message). ``parent`` and ``cqs`` are the
    ConsumeQueue states, resolved under the store lock and re-resolved when the table's
    ``generation`` moved (a state was evicted and may come back as a new object).
    """

    __slots__ = (
        "cqs", "fixed_size", "generation", "inner_head", "lights", "max_inner", "parent",
        "props_room", "queues", "size_room", "topic", "topic_field", "units",
    )  # fmt: skip

    def __init__(
        self, topic: str, topic_bytes: bytes, lights: tuple[str, ...], max_record: int
    ) -> None:
        self.topic = topic
        self.lights = lights
        #: TOPICLENGTH + TOPIC, as they follow the body in the record.
        self.topic_field = bytes((len(topic_bytes),)) + topic_bytes
        #: Record size without body and properties (those vary per message).
        self.fixed_size = _RECORD_OVERHEAD + len(topic_bytes)
        self.units = 1 + len(lights)
        #: The INNER_* properties up to the offsets (format.inner_head); the record step adds
        #: the offsets and their separator.
        self.inner_head = inner_head(lights)
        #: Longest the INNER_* pair can get (19-digit offsets, commas, \x02): a message whose
        #: properties fit with it always fits, so size errors are raised before anything is
        #: written.
        self.max_inner = len(self.inner_head) + len(lights) * (len(str(_MAX_OFFSET)) + 1)
        #: Room left for user properties, and for body plus user properties, in the worst
        #: case: one comparison each per message; Appender._check_size says what was exceeded.
        self.props_room = _MAX_USER_PROPS - self.max_inner
        self.size_room = max_record - self.fixed_size - self.max_inner
        self.generation = -1  # never resolved
        self.parent: ConsumeQueue
        self.cqs: tuple[ConsumeQueue, ...] = ()
        #: The parent then the light queues: every queue a record of this route joins.
        self.queues: tuple[ConsumeQueue, ...] = ()

    def resolve(self, table: ConsumeQueueTable) -> None:
        self.parent = table.get_or_create(self.topic)
        self.cqs = tuple([table.get_or_create(q) for q in self.lights])
        self.queues = (self.parent, *self.cqs)
        self.generation = table.generation


#: A validated message waiting for the lock: (route, body, user properties, born timestamp).
Prepared = tuple[Route, bytes, bytes, "int | None"]
#: One message of :meth:`MessageStore.append_encoded`: (topic, light queues, body, property
#: block from :meth:`MessageStore.encode_properties`).
EncodedMessage = tuple[str, tuple[str, ...], bytes, bytes]


def prepare_run_py(
    messages: list[EncodedMessage],
    i: int,
    routes: dict[tuple[str, tuple[str, ...]], Route],
    max_body: int,
    born: int | None,
    batch: list[Prepared],
    touched: dict[Route, None],
) -> int:
    """Appender.append's validation loop, its common case: from ``messages[i]`` on, while a
    message's route is cached and its body and properties fit the route's worst-case room and
    ``max_body``, append (route, body, block, born) to ``batch`` and mark the route in
    ``touched``; return the index of the first message left (the caller routes it or checks
    it in full, and raises what it must). The reference of store/_speedups.c ``prepare_run``
    (tests/store/test_write_run.py)."""
    n = len(messages)
    while i < n:
        topic, lights, body, uprops = messages[i]
        route = routes.get((topic, lights))
        if route is None:
            break
        blen = len(body)
        plen = len(uprops)
        if blen > max_body or blen + plen > route.size_room or plen > route.props_room:
            break
        batch.append((route, body, uprops, born))
        touched[route] = None
        i += 1
    return i


def _write_record(
    route: Route,
    body: bytes,
    uprops: bytes,
    born: int,
    now: int,
    buf: bytearray,
    limit: int,
    phys: int,
    dirty: dict[str, ConsumeQueue],
    results: list[PutResult],
    put_result: type[PutResult],
) -> int:
    """One record of the references' runs (write_run_py, append_batch_py) at ``phys``: the
    record written, its unit dispatched to the route's queues, its PutResult added; its size,
    or < 0 if it does not fit before ``limit`` (nothing is changed then)."""
    qoff = route.parent.max_offset
    lo: dict[str, int] = {}
    for cq in route.cqs:
        lo[cq.name] = cq.max_offset
    size = _append_record(
        buf, limit - phys, qoff, phys, born, now, body, route.topic_field, uprops,
        route.inner_head, tuple(lo.values()),
    )  # fmt: skip
    if size >= 0:
        dispatch(route.queues, _pack_unit(phys, size, 0), dirty)
        results.append(_tuple_new(put_result, (phys, qoff, lo, phys + size, now)))
    return size


def write_run_py(
    batch: list[Prepared],
    i: int,
    now: int,
    buf: bytearray,
    limit: int,
    state: list[int],
    generation: int,
    dirty: dict[str, ConsumeQueue],
    results: list[PutResult],
    put_result: type[PutResult],
) -> int:
    """Appender._section's common case: from ``batch[i]`` on, while a message's route is
    resolved for ``generation`` and its record fits before ``limit``, append the record,
    dispatch its unit to the route's queues and add its PutResult to ``results``; return the
    index of the first message left (a route to resolve again, a record for the next segment).
    ``state`` = [next physical offset, units dispatched] is written back on every exit, errors
    included. The reference of store/_speedups.c ``write_run``, which must give the same
    bytes, queues and results (tests/store/test_write_run.py)."""
    phys, units = state
    n = len(batch)
    try:
        while i < n:
            route, body, uprops, born = batch[i]
            if route.generation != generation:
                break
            size = _write_record(
                route, body, uprops, now if born is None else born, now, buf, limit, phys,
                dirty, results, put_result,
            )  # fmt: skip
            if size < 0:
                break
            units += route.units
            phys += size
            i += 1
    finally:
        state[0] = phys
        state[1] = units
    return i


def append_batch_py(
    messages: list[EncodedMessage],
    routes: dict[tuple[str, tuple[str, ...]], Route],
    max_body: int,
    now: int,
    buf: bytearray,
    limit: int,
    state: list[int],
    generation: int,
    dirty: dict[str, ConsumeQueue],
    results: list[PutResult],
    put_result: type[PutResult],
    ends: dict[str, int],
) -> int:
    """Appender.append's common case in one call, lock held (Appender._append_common):
    prepare_run_py's checks and write_run_py's writing fused, with no prepared tuple.

    If a message is not on a route cached in ``routes`` and resolved for ``generation``, or
    not within its route's worst-case room or ``max_body``, nothing is written or changed and
    the answer is -1 (the general loops do the batch). Otherwise the records are written from
    the first on (born = stored = ``now``) as write_run_py writes them, until one needs the
    next segment (the general loop rolls and writes the rest); the answer is the index of the
    first not written. When all were, ``ends`` gets what :meth:`Appender._notify` would tell
    the listeners: every queue touched and where it ends, the routes in batch order.
    ``state`` = [next physical offset, units dispatched] is written back on every exit. The
    reference of store/_speedups.c ``append_batch``, which must give the same bytes, queues,
    results and ends (tests/store/test_append_batch.py)."""
    found: list[Route] = []
    for m in messages:
        if type(m) is not tuple or len(m) != 4:
            return -1
        topic, lights, body, uprops = m
        if (
            type(lights) is not tuple
            or not isinstance(body, bytes)
            or not isinstance(uprops, bytes)
        ):
            return -1
        route = routes.get((topic, lights))
        if route is None or route.generation != generation:
            return -1
        blen = len(body)
        plen = len(uprops)
        if blen > max_body or blen + plen > route.size_room or plen > route.props_room:
            return -1
        found.append(route)
    phys, units = state
    i = 0
    try:
        for route, (_, _, body, uprops) in zip(found, messages, strict=True):
            size = _write_record(
                route, body, uprops, now, now, buf, limit, phys, dirty, results, put_result
            )
            if size < 0:
                break
            units += route.units
            phys += size
            i += 1
    finally:
        state[0] = phys
        state[1] = units
    if i == len(found):
        for route in found:
            ends[route.topic] = route.parent.max_offset
            for cq in route.cqs:
                ends[cq.name] = cq.max_offset
    return i


#: The Route and ConsumeQueue slots store/_speedups.c ``append_batch`` reads and sets, in the
#: order its ``configure_batch`` takes them.
BATCH_ROUTE_SLOTS = (
    "generation", "parent", "cqs", "queues", "topic", "topic_field", "inner_head", "units",
    "size_room", "props_room",
)  # fmt: skip
BATCH_QUEUE_SLOTS = ("name", "max_offset", "pending")

_record_kernel = load_kernel()
_run_kernel = load_kernel("LMQTT_PURE_PYTHON_APPEND")
_append_record: Callable[..., int] = getattr(_record_kernel, "append_record", append_record)
_write_run: Callable[..., int] = getattr(_run_kernel, "write_run", write_run_py)
_prepare_run: Callable[..., int] = getattr(_run_kernel, "prepare_run", prepare_run_py)
if _run_kernel is not None:
    _run_kernel.configure_batch(Route, BATCH_ROUTE_SLOTS, ConsumeQueue, BATCH_QUEUE_SLOTS)
_append_batch: Callable[..., int] = getattr(_run_kernel, "append_batch", append_batch_py)
#: Whether the record step runs in C.
SPEEDUPS = _append_record is not append_record


class Appender:
    """The store's writer: validates messages, appends and dispatches them under ``lock``.

    ``lock`` is the store's one lock (reads and deletions take it too); ``closed`` is set
    under it when the store closes. ``listeners`` are told where the queues a put touched
    end, after the lock is released, in the putting thread.
    """

    def __init__(
        self, commitlog: CommitLog, table: ConsumeQueueTable, lock: threading.Lock, max_body: int
    ) -> None:
        self.commitlog = commitlog
        self.table = table
        self.lock = lock
        self.max_body = max_body
        self.closed = False
        self.listeners: tuple[ArrivalListener, ...] = ()
        self.routes: dict[tuple[str, tuple[str, ...]], Route] = {}
        #: Store timestamp of the last append: taken under the lock and never decreasing.
        self.last_store_ts = 0
        #: Units dispatched to every queue so far (the checkpoint's count).
        self.units_total = 0
        #: Set by a full flush waiting for the lock: the writer yields once after its section.
        self.lock_wanted = False

    # -- validation ----------------------------------------------------------------------------
    @staticmethod
    def check_name(name: str, *, topic: bool) -> bytes:
        """The UTF-8 form of a queue (or, with ``topic``, parent topic) name, or
        InvalidQueueNameError."""
        if not isinstance(name, str) or not name:
            raise InvalidQueueNameError(str(name), "empty or not a string")
        bad = _FORBIDDEN_NAME_CHARS.intersection(name)
        if bad:
            raise InvalidQueueNameError(name, f"contains reserved character(s) {sorted(bad)!r}")
        try:
            encode_queue_dir(name)
            raw = name.encode("utf-8")
        except (ValueError, UnicodeEncodeError) as e:
            raise InvalidQueueNameError(name, str(e)) from e
        if topic and len(raw) > MAX_TOPIC_BYTES:
            raise InvalidQueueNameError(name, f"topic longer than {MAX_TOPIC_BYTES} bytes")
        return raw

    @staticmethod
    def encode_properties(properties: dict[str, str]) -> bytes:
        """Validated ``key \x01 value \x02`` pairs (see MessageStore.encode_properties)."""
        parts = []
        for k, v in properties.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidPropertyError(f"property {k!r}: keys and values must be str")
            if k in RESERVED_PROPERTIES:
                raise InvalidPropertyError(f"property {k!r} is reserved by the store")
            if not k or "\x01" in k or "\x02" in k or "\x01" in v or "\x02" in v:
                raise InvalidPropertyError(f"property {k!r}: empty key or separator character")
            parts.append(f"{k}\x01{v}\x02")
        return "".join(parts).encode("utf-8")

    def _new_route(self, key: tuple[str, tuple[str, ...]]) -> Route:
        """Validate a (topic, light queues) pair seen for the first time and cache its route."""
        topic, queues = key
        tb = self.check_name(topic, topic=True)
        for q in queues:
            self.check_name(q, topic=False)
        lights = tuple(dict.fromkeys(queues))
        if topic in lights:
            raise InvalidQueueNameError(topic, "a light queue may not be the parent topic")
        route = Route(topic, tb, lights, self.commitlog.max_record_size())
        if len(self.routes) >= _ROUTE_CACHE_LIMIT:
            self.routes.clear()
        self.routes[key] = route
        return route

    def _check_size(self, route: Route, body_len: int, props_len: int) -> None:
        """Refuse a message that could exceed the property or segment limits once written."""
        props_len += route.max_inner
        if props_len > _MAX_USER_PROPS:
            raise InvalidPropertyError(f"properties of up to {props_len} bytes are too long")
        size = route.fixed_size + body_len + props_len
        if size > self.commitlog.max_record_size():
            raise MessageTooLargeError(size, self.commitlog.max_record_size())

    # -- entry points --------------------------------------------------------------------------
    def append(self, messages: Sequence[EncodedMessage], born: int | None) -> list[PutResult]:
        """Validate (before the lock), append, then tell the listeners; ``born`` is the born
        timestamp of every message (None: the store timestamp)."""
        items = messages if type(messages) is list else list(messages)
        if born is None:
            results = self._append_common(items)
            if results is not None:
                return results
        routes = self.routes
        max_body = self.max_body
        batch: list[Prepared] = []
        touched: dict[Route, None] = {}
        n = len(items)
        i = 0
        while True:
            i = _prepare_run(items, i, routes, max_body, born, batch, touched)
            if i >= n:
                break
            topic, lights, body, uprops = items[i]  # a new route, or a size to check in full
            route = routes.get((topic, lights))
            if route is None:
                route = self._new_route((topic, tuple(lights)))
            blen = len(body)
            if blen > max_body:
                raise MessageTooLargeError(blen, max_body)
            if blen + len(uprops) > route.size_room or len(uprops) > route.props_room:
                self._check_size(route, blen, len(uprops))
            touched[route] = None
            batch.append((route, body, uprops, born))
            i += 1
        results = self._section(batch)
        if self.listeners:
            self._notify(touched)
        return results

    def _append_common(self, items: list[EncodedMessage]) -> list[PutResult] | None:
        """:meth:`append` of a batch whose messages all have a cached, resolved route and fit
        it, born now: checked and written by one ``_append_batch`` call under the lock (the
        rest through the general loop if a record needs the next segment), the listeners told
        after. None (nothing written) when one does not qualify: the general path does it."""
        ends: dict[str, int] | None = {}
        with self.lock:
            if self.closed:
                raise StoreClosedError("store is closed")
            now = int(_time() * 1000)  # as in _section: never decreasing
            if now < self.last_store_ts:
                now = self.last_store_ts
            self.last_store_ts = now
            table = self.table
            try:
                results: list[PutResult] = []
                gen = table.generation
                writer = self.commitlog.batch()
                state = [writer.start, 0]  # next physical offset, units dispatched
                try:
                    i = _append_batch(
                        items, self.routes, self.max_body, now, writer.buf, writer.limit, state,
                        gen, table.dirty, results, PutResult, ends,
                    )  # fmt: skip
                    if i < 0:
                        return None
                    if i < len(items):  # the next segment: the general loop rolls
                        routes = self.routes
                        rest: list[Prepared] = [
                            (routes[(m[0], m[1])], m[2], m[3], None) for m in items[i:]
                        ]
                        self._write(writer, rest, 0, now, gen, state, results)
                        ends = None
                finally:
                    writer.finish(state[0])
                    self.units_total += state[1]
            finally:
                if len(table.states) > table.max_cached:
                    table.evict_overflow()
        if self.lock_wanted:
            time.sleep(0)  # as in _section
        if self.listeners:
            if ends is None:
                routes = self.routes
                ends = self._ends(dict.fromkeys([routes[(m[0], m[1])] for m in items]))
            self._tell(ends)
        return results

    def put(
        self,
        topic: str,
        body: bytes,
        queues: Sequence[str],
        properties: dict[str, str] | None,
        born_timestamp: int | None,
    ) -> PutResult:
        """:meth:`append`'s checks for a batch of one, without its loop: one message per
        call is the path of retained messages and wills, and of tools."""
        uprops = self.encode_properties(properties) if properties else b""
        key = (topic, queues if type(queues) is tuple else tuple(queues))
        route = self.routes.get(key) or self._new_route(key)
        blen = len(body)
        if blen > self.max_body:
            raise MessageTooLargeError(blen, self.max_body)
        if blen + len(uprops) > route.size_room or len(uprops) > route.props_room:
            self._check_size(route, blen, len(uprops))
        r = self._section(((route, body, uprops, born_timestamp),))[0]
        if self.listeners:
            self._notify((route,))
        return r

    def _notify(self, routes: Iterable[Route]) -> None:
        """Tell the listeners where the queues of ``routes`` end, once per queue.

        Queue ends are read after the lock: later puts only move them further, and a
        listener is told "ends at least here", once per queue for the whole batch.
        """
        self._tell(self._ends(routes))

    @staticmethod
    def _ends(routes: Iterable[Route]) -> dict[str, int]:
        """Every queue of ``routes`` and where it ends now."""
        ends: dict[str, int] = {}
        for route in routes:
            ends[route.topic] = route.parent.max_offset
            for cq in route.cqs:
                ends[cq.name] = cq.max_offset
        return ends

    def _tell(self, ends: dict[str, int]) -> None:
        """Tell every listener where the queues an append touched end."""
        for listener in self.listeners:
            try:
                batch = getattr(listener, "on_arrivals", None)
                if batch is not None:
                    batch(ends)  # the whole batch in one call
                else:
                    for q, m in ends.items():
                        listener.on_arrival(q, m)
            except Exception:
                log.exception("arrival listener %r failed", listener)

    # -- the critical section ------------------------------------------------------------------
    def _section(self, batch: Sequence[Prepared]) -> list[PutResult]:
        """Write a prepared batch under one lock acquisition: assign every offset, append the
        records and dispatch their units.

        The common case, a run of records that fit in the segment on routes resolved already,
        is ``_write_run`` (store/_speedups.c ``write_run``, or its reference ``write_run_py``);
        the record it stops at (a route to resolve, a segment to roll) is ``_write_one``.
        Sizes were checked against the worst case when the batch was prepared, so nothing here
        should fail; should it anyway, each record is complete in the buffer before its queues
        move and ``finally`` writes out the records whose queues moved, leaving those written
        and dispatched. One frame for the whole section: it runs once per batch.
        """
        with self.lock:
            if self.closed:
                raise StoreClosedError("store is closed")
            # Taken under the lock and never decreasing, so store timestamps follow the log
            # order (offset_by_time bisects on them) even if the wall clock steps back.
            now = int(_time() * 1000)
            if now < self.last_store_ts:
                now = self.last_store_ts
            self.last_store_ts = now
            table = self.table
            try:
                gen = table.generation
                results: list[PutResult] = []
                writer = self.commitlog.batch()
                state = [writer.start, 0]  # next physical offset, units dispatched
                items = batch if type(batch) is list else list(batch)
                try:
                    self._write(writer, items, 0, now, gen, state, results)
                finally:
                    writer.finish(state[0])
                    self.units_total += state[1]
            finally:
                if len(table.states) > table.max_cached:
                    table.evict_overflow()
        if self.lock_wanted:
            # A full flush waits for the lock: let it have it before our next put.
            time.sleep(0)
        return results

    def _write(
        self,
        writer: BatchWriter,
        items: list[Prepared],
        i: int,
        now: int,
        gen: int,
        state: list[int],
        results: list[PutResult],
    ) -> None:
        """Write ``items[i:]``: runs by ``_write_run``, the record it stops at by
        ``_write_one``. Lock held."""
        n = len(items)
        dirty = self.table.dirty
        while True:
            i = _write_run(
                items, i, now, writer.buf, writer.limit, state, gen, dirty, results, PutResult
            )
            if i >= n:
                break
            self._write_one(writer, items[i], now, gen, state, results)
            i += 1

    def _write_one(
        self,
        writer: BatchWriter,
        item: Prepared,
        now: int,
        gen: int,
        state: list[int],
        results: list[PutResult],
    ) -> None:
        """One record ``_write_run`` left: resolve its route, or roll to the next segment.
        Lock held."""
        table = self.table
        route, body, uprops, born = item
        if route.generation != gen:
            route.resolve(table)
        phys = state[0]
        qoff = route.parent.max_offset
        # The light offsets, as PutResult reports them (a queue's name is its key).
        lo: dict[str, int] = {}
        for cq in route.cqs:
            lo[cq.name] = cq.max_offset
        stamp = now if born is None else born
        size = _append_record(
            writer.buf, writer.limit - phys, qoff, phys, stamp, now, body, route.topic_field,
            uprops, route.inner_head, tuple(lo.values()),
        )  # fmt: skip
        if size < 0:
            phys = state[0] = writer.roll(
                phys, route.fixed_size + len(body) + len(uprops) + route.max_inner
            )
            size = _append_record(
                writer.buf, writer.limit - phys, qoff, phys, stamp, now, body,
                route.topic_field, uprops, route.inner_head, tuple(lo.values()),
            )  # fmt: skip
            if size < 0:  # unreachable: _check_size saw the worst case
                raise MessageTooLargeError(route.fixed_size + len(body), writer.limit - phys)
        dispatch(route.queues, _pack_unit(phys, size, 0), table.dirty)
        state[1] += route.units
        end = phys + size
        results.append(_tuple_new(PutResult, (phys, qoff, lo, end, now)))
        state[0] = end
