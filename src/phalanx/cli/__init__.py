"""The ``phalanx`` command line: ``phalanx run`` starts and supervises local workers."""
