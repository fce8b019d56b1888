"""Transports: the framings of HTTP/1.1, HTTP/2 and HTTP/3 over one request intake.

`streams.StreamTable` is what every framing shares (intake per request, proxy tasks, cancel,
crash reporting, stall watcher, rapid-reset guard). `h3layer` is pylon's own HTTP/3 request layer
on aioquic's public QUIC API; `quic_private` holds the only aioquic internals pylon touches;
`stateless_reset` builds the QUIC stateless resets (RFC 9000 10.3) that end a connection whose
packets reached a process that does not hold it (several processes on one UDP port).
"""
