"""One function builds the core: the engine and the dispatcher over a store.

The server, the HTTP side (which it hands the core) and the tests on
trio's MockClock all build it here, so it is wired one way.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobserver.core.commands.dispatch import Dispatcher
from jobserver.core.commands.route import Access, Gauges, NoGauges, Services
from jobserver.core.engine.clock import Clock
from jobserver.core.engine.context import Settings
from jobserver.core.engine.engine import Engine
from jobserver.core.engine.history import DEFAULT_MINUTES, History
from jobserver.storage.interface import Storage


@dataclass(frozen=True)
class Core:
    store: Storage
    engine: Engine
    dispatcher: Dispatcher


def build_core(
    store: Storage,
    clock: Clock,
    settings: Settings,
    access: Access | None = None,
    gauges: Gauges | None = None,
    threaded: bool = True,
    history_minutes: int = DEFAULT_MINUTES,
) -> Core:
    """The core over `store`; `threaded=False` runs every batch on the event
    loop (for trio's MockClock); `history_minutes` is the window of the
    history (--history-minutes, 0 none). Start it with `core.engine.start()` and
    run `core.engine.run()` (and, with other nodes, `listen()`) beside it."""
    engine = Engine(store, clock, settings, threaded, History(history_minutes, clock))
    services = Services(store, engine, access or Access(), gauges or NoGauges())
    return Core(store, engine, Dispatcher(services))
