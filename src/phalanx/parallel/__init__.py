"""The data-parallel engine: buckets, overlap, compression, batch norm. Built on phalanx.comm."""
