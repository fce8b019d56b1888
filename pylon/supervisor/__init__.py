"""`pylon serve --processes N`: one supervisor, N pylon processes on one port pair.

The supervisor does once what must be done once (the CLI validated the settings and checked the
refusals before it starts): a private runtime directory, the self-signed certificate every
process presents (without --tls-cert), the QUIC stateless-reset key they share, the sockets
(SO_REUSEPORT; `--listen host:0` is one port for the node), and the node's admin listener.
It then keeps N processes running (restarts with backoff), forwards SIGHUP and SIGUSR1/2, and on
SIGTERM/SIGINT/SIGQUIT drains them all. With --routing on it also runs the node's booking
authority as one more process, role "router" (`process="router"`), which every serving process
books at. `--processes 1` runs no supervisor at all.

Nothing is imported here: a process (`python -m pylon.supervisor.child`) loads only what it runs.

- supervisor.py: `supervise` (the node's life), `Supervisor` (the slots, restarts, signals).
- sockets.py: `bind_node`: the TCP placeholder and the held UDP sockets, and why.
- handover.py: `Handover` (what a process is given, as a 0600 JSON file), `child_command`
  (the command line of a process of role "pylon", or "router": the booking authority).
- child.py: the process side (`python -m pylon.supervisor.child`): adopt, serve, watch the
  supervisor (EOF of the control socket).
- backoff.py: `Backoff`, the restart delays (pure).
- admin.py: `NodeAdmin`, the node's /live, /ready and /metrics; scrape.py: one bounded request
  to a process's admin on its Unix socket; router_admin.py: `RouterAdmin`, the router's own
  admin (its routing figures: the node's real bookings).
- metrics.py: `merge_expositions` (pure): each process's samples labelled `process="i"`, and
  the supervisor's own families.

docs/operations.md, "Processes (--processes N)", says it for operators.
"""
