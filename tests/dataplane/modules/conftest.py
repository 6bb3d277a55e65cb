"""Fixtures shared by the module tests; what they build is in the helper modules next to this one
(`one_copy_support`, `plane_support`, `management_support`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.dataplane.modules.management_support import Running, running_servers
from tests.dataplane.modules.one_copy_support import Direct, DirectFactory, direct_planes
from tests.dataplane.modules.plane_support import Caches, Plane, PlaneFactory, planes


@pytest.fixture
def make_direct() -> Iterator[DirectFactory]:
    yield from direct_planes()


@pytest.fixture
def direct(make_direct: DirectFactory) -> Direct:
    return make_direct()


@pytest.fixture
def make_plane(make_caches: Callable[[], Caches]) -> Iterator[PlaneFactory]:
    yield from planes(make_caches)


@pytest.fixture
def plane(make_plane: PlaneFactory) -> Plane:
    return make_plane()


@pytest.fixture
def running() -> Iterator[Callable[..., Running]]:
    """Real server loops in this process, assembled as ``build_dataplane`` assembles them, with
    the modules a test wants."""
    yield from running_servers()
