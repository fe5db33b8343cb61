"""What a chunk is: keys and hashes, layouts, the record format, codecs."""
