from tests.gateway.tunnel_fixtures import make_tunnel

__all__ = ["make_tunnel"]
