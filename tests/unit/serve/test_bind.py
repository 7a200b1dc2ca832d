"""Where the server cannot listen, the error names what to change: the port when it is taken,
the host when it is not an address of this machine."""
from __future__ import annotations

import pytest

from graphmode.errors import GraphmodeError
from graphmode.serve.app import bind


@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])     # unresolvable; TEST-NET-1, not ours
def test_a_host_that_is_not_this_machines_is_named_with_its_fix(host):
    """Trial AD: both said 'pick a free port'."""
    with pytest.raises(GraphmodeError) as e:
        bind(host, 0)
    assert e.value.where == "--host" and "127.0.0.1" in e.value.fix and "port" not in e.value.fix


def test_a_port_in_use_is_named_with_its_fix():
    taken = bind("127.0.0.1", 0)
    try:
        with pytest.raises(GraphmodeError) as e:
            bind("127.0.0.1", taken.getsockname()[1])
        assert e.value.where == "--host/--port" and "free port" in e.value.fix
    finally:
        taken.close()
