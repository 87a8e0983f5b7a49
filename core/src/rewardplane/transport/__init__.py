"""Both sides of the weight transfer: process groups over a TCPStore (``comm``), flat buckets
(``buckets``), and the streamed send and receive (``transfer``). Needs torch; the trainer's SDK
and the reward server's workers use the same code, so both compute the same layout."""
