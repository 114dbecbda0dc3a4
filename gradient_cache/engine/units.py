"""Byte units, in the engine's lowest layer so that the engine and the facade share them."""

MIB = 2**20
