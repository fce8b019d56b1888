"""The worker-selection boundary around Dynamo's native selection core (issue: router_ffi).

Empty for now: pylon's routing seam is `pylon.routing.Router`; a KV-aware router implementing it
will live here, the only code that touches the native object.
"""
