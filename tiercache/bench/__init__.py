"""Measurement code the benchmark scripts and ``tiercache bench`` share.

``tiers``: the data plane against the raw hardware (what ``tiercache bench`` runs);
``measure``: the timed regions (imports torch); ``rawio``: the raw baselines (O_DIRECT
reads, pwrite loops, plain copies). Not part of the data plane: nothing there imports it.
"""
