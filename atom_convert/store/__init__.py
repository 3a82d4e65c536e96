"""A converted directory as stored: the manifest (typed, written last), source and options fingerprints, the
destination's staging, lock and journal, and the reader of converted files. Imports `files` and `layout`."""
