"""Fixtures live in tests/fixtures/, one module per area, so that each can grow on its own."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.daemon",
    "tests.fixtures.netlab",
    "tests.fixtures.mesh",
    "tests.fixtures.api",
    "tests.fixtures.families",
    "tests.fixtures.workers",
]
