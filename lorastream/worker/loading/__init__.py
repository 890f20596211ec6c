"""Tiered adapter loading: store → host buffer → device slot, off the decode path."""
