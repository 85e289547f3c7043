"""The TensorFlow port's codec classes by registry name: what a wrapper's ``compression="name"``
resolves to. A module of its own so that the wrappers import it without importing the
package that re-exports them."""

from hvd_compress.registry import port_codecs

CODECS = port_codecs(__package__)
