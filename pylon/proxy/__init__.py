"""The proxy: admission (contract, auth, lifecycle), forwarding (plan, route, send) and relay.

Transports reach it through two calls: `ProxyAdmission.admit` at headers time (via the intake)
and `Proxy.handle` once the whole request arrived; `Proxy.reject` answers pylon's own problems.
"""

from pylon.proxy.admission import ProxyAdmission
from pylon.proxy.forwarding import Proxy
from pylon.proxy.relay import RelayLimits
from pylon.proxy.sink import ResponseSink, send_problem

__all__ = ["Proxy", "ProxyAdmission", "RelayLimits", "ResponseSink", "send_problem"]
