"""Byte units shared across the package: one mebibyte, ``MIB``, is 2**20 bytes."""

MIB = 2**20
