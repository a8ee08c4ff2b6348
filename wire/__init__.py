"""The wire rules: what every side of the wire must compute alike, in one room that the
model (``lm``), the server, the client and the Moses tooling import and that imports none
of them (only ``common`` and the libraries each module names).

    ngrams   canonical n-gram rows, sentence windows, word → id packing (numpy only)
    tokens   what a token file holds (standard library only)
    logbase  log bases: their names and the conversion of scores (standard library only)
    status   each error and refusal → its gRPC status code, and the codes a client retries (grpc)

Each rule has a golden file in proto/contract/ that the C++ owner reads too.

Import path: ``nlmserve.wire`` (folder ``wire/``).
"""
