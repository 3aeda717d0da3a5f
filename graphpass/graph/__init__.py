"""Reading the joint forward+backward graph: node classes, module paths, saved edges, bytes."""
