"""Reading and writing files: torch zip/pickle files, safetensors, DCP metadata, output files and their checksums.

Every byte that comes from a checkpoint is checked here before it is used; nothing here knows a framework.
"""
