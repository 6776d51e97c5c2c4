"""Transport: turning nests of arrays into buffers and moving them with MPI."""
