"""The engine side: HTTP/1.1 keep-alive connections per target, capped, on httptools."""
