"""What commands write: the files each kind of output folder holds (``layout``), where a command may write
(``paths``: never over its inputs, nor into a folder another command made) and the lock that keeps a run folder
to one run (``lock``)."""
