# Pylon's copy of the reverse-tunnel messages, written from the table in docs/gateway.md. The file
# id, the struct names and the field ordinals and types are the wire contract shared with the
# gateway; loaded at run time by pycapnp (pylon.gateway.wire), never compiled.
@0xcccc1d2d6dc1a2ac;

# Raw-QUIC tunnel: each request stream carries these, one after another: headers first (with the
# pseudo fields x-method and x-path, the answer's with x-status), body chunks, optional trailers.
struct Message {
  union {
    headers @0 :Map(Text, Text);
    body @1 :Body;
    trailers @2 :Map(Text, Text);
  }
}

struct Body {
  content @0 :Data;
}

struct Map(Key, Value) {
  entries @0 :List(Entry);
  struct Entry {
    key @0 :Key;
    value @1 :Value;
  }
}

# The first bidirectional stream pylon opens on a reverse-tunnel connection carries one Handshake;
# the gateway answers one HandshakeAck on it. authToken stays unset when pylon has no token.
struct Handshake {
  inferenceServerId @0 :Text;
  authToken @1 :Text;
}

struct HandshakeAck {
  accepted @0 :Bool;
  reason @1 :Text;
}
