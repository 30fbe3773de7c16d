"""Integration fixtures (real nginx, Redis and engine simulators): defined in
``gwfixtures.py`` so test modules can also import its helpers by name."""

from gwfixtures import (  # noqa: F401  (re-exported fixtures)
    fleet,
    fleet_clean,
    start_gateway,
    start_redis,
    start_sims,
)
from ctlfixtures import (  # noqa: F401  (re-exported fixtures)
    control_fleet,
    control_fleet_module,
)
from mockengine import start_mocks  # noqa: F401  (re-exported fixture)
