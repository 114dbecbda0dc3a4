"""Byte units: one mebibyte, ``MIB``, is 2**20 bytes.

In the engine, the package's lowest layer after the codecs, so that the engine and the
facade (stats, planner, cli, linkrate, the demo) share the one constant.
"""

MIB = 2**20
